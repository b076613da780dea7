"""Budget rules and settings checks of SPEC.md."""

from __future__ import annotations

import pytest

from h2o_cli.config import CacheSettings, parse_budget
from h2o_cli.errors import UsageError


@pytest.mark.parametrize(
    ("value", "context", "tokens"),
    [
        ("0.1", 8192, 819),
        ("1", 8192, 8192),
        ("512", 8192, 512),
        (0.5, 10, 5),
        ("2", 100, 2),
        ("20000", 8192, 20000),
    ],
)
def test_budget_values(value, context, tokens):
    assert parse_budget(value, context) == tokens


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "abc", "", "0.0001", "1.5", "-0.2"])
def test_bad_budgets_are_usage_errors(value):
    with pytest.raises(UsageError) as error:
        parse_budget(value, 8192)
    assert "--budget" in str(error.value) and "\n" not in str(error.value)


def test_split_heavy_recent():
    settings = CacheSettings(budget=101, heavy_ratio=0.5)
    assert settings.heavy + settings.recent == 101
    assert CacheSettings(budget=10, policy="local").recent == 10
    assert CacheSettings(budget=10, policy="sink", sinks=4).heavy == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(budget=1),
        dict(budget=10, policy="nope"),
        dict(budget=10, positions="absolute"),
        dict(budget=10, heavy_ratio=1.5),
        dict(budget=10, chunk=0),
        dict(budget=4, policy="sink", sinks=4),
        dict(budget=10, score_norm="max"),
    ],
)
def test_settings_reject_nonsense(kwargs):
    with pytest.raises(UsageError):
        CacheSettings(**kwargs)
