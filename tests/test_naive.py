"""The naive reference (tests/naive.py) stays independent of the code it checks."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from naive import heavy_slots, recall_slots, recent_slots, resident_budget

NAIVE = Path(__file__).resolve().parent / "naive.py"


def test_naive_reference_imports_nothing_from_h2o_cli():
    """A reference that imported the policies (or anything else of h2o_cli) would agree with any bug in them."""
    tree = ast.parse(NAIVE.read_text())
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append(node.module or "")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
            "__import__",
            "import_module",
        ):
            imported.append(ast.unparse(node))
    assert not [name for name in imported if "h2o" in name], imported


def test_naive_reference_reads_only_plain_settings_fields():
    """`settings.X` in the reference is a stored field, never a property that asks the policy (`recent`,
    `heavy` call make_policy: the reference must do that arithmetic itself)."""
    from h2o_cli.config import CacheSettings

    tree = ast.parse(NAIVE.read_text())
    read = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "settings"
    }
    assert read, "the reference reads no settings?"
    assert read <= {field.name for field in dataclasses.fields(CacheSettings)}, read


def slots(**fields):
    settings = SimpleNamespace(**{"heavy_ratio": 0.5, "recall_ratio": 0.5, "sinks": 4, **fields})
    return recall_slots(settings), resident_budget(settings), heavy_slots(settings), recent_slots(settings)


@pytest.mark.parametrize(
    "fields, want",
    [
        # (recall r, resident |S|, heavy, recent), worked by hand from SPEC.md and docs/spec.md
        (dict(policy="h2o", budget=8), (0, 8, 4, 4)),
        (dict(policy="h2o", budget=8, heavy_ratio=0.7), (0, 8, 6, 2)),  # round(5.6)
        (dict(policy="h2o", budget=7), (0, 7, 4, 3)),  # round(3.5): Python rounds half to even
        (dict(policy="tova", budget=10, heavy_ratio=0.25), (0, 10, 2, 8)),  # round(2.5) = 2
        (dict(policy="sink", budget=8, sinks=3), (0, 8, 3, 5)),
        (dict(policy="local", budget=8), (0, 8, 0, 8)),
        (dict(policy="recall", budget=8, recall_ratio=0.75), (6, 2, 1, 1)),
        (dict(policy="recall", budget=8, recall_ratio=0.2), (2, 6, 3, 3)),  # round(1.6)
        (dict(policy="recall", budget=8, recall_ratio=0.2, heavy_ratio=0.75), (2, 6, 4, 2)),  # round(4.5)
        (dict(policy="recall", budget=10, recall_ratio=0.3, heavy_ratio=0.5), (3, 7, 4, 3)),  # round(3.5)
        (dict(policy="recall", budget=8, recall_ratio=0.9), (6, 2, 1, 1)),  # round(7.2), but 2 stay resident
        (dict(policy="recall", budget=2, recall_ratio=0.5), (0, 2, 1, 1)),  # a 2-token budget recalls nothing
        (dict(policy="recall", budget=20, recall_ratio=0.9), (18, 2, 1, 1)),
    ],
)
def test_naive_slot_split_is_the_contracts_arithmetic(fields, want):
    assert slots(**fields) == want


@pytest.mark.parametrize("policy", ["h2o", "tova", "sink", "local", "full", "recall"])
def test_policies_split_the_budget_as_the_naive_reference_does(policy):
    """The policies' slot counts against the reference's arithmetic over budgets and ratios where rounding
    matters (halves, .6s), so a changed rounding rule in the policies shows here before any simulation."""
    from h2o_cli.config import CacheSettings
    from h2o_cli.errors import UsageError
    from h2o_cli.policies import make_policy

    compared = 0
    for budget in range(4, 21):
        for heavy_ratio in (0.0, 0.25, 0.3, 0.5, 0.7, 0.75, 1.0):
            for recall_ratio in (0.0, 0.2, 0.3, 0.5, 0.9, 1.0) if policy == "recall" else (0.5,):
                fields = dict(
                    policy=policy, budget=budget, heavy_ratio=heavy_ratio, recall_ratio=recall_ratio
                )
                try:
                    made = make_policy(CacheSettings(chunk=4, sinks=3, **fields))
                except UsageError:  # a split the policy rejects (e.g. a resident set under 2)
                    continue
                got = (made.recall_slots, budget - made.recall_slots, made.heavy_slots, made.recent_slots)
                assert got == slots(sinks=3, **fields), fields
                compared += 1
    assert compared >= 17 * 7
