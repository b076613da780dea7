"""Policies own their meaning: the registry, each policy's checks and split, and adding a policy in one class."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import REPO

from h2o_cli import policies, policy_registry
from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError
from h2o_cli.policies import Policy, make_policy, policy_names, register
from h2o_cli.streaming import stream_perplexity


@dataclass(frozen=True)
class FirstTokensPolicy(Policy):
    """Test-only: keep the first tokens of the stream, evict the newest entry (the opposite of `local`)."""

    name: ClassVar[str] = "first"

    @property
    def heavy_slots(self) -> int:
        return self.budget

    def priority(self, state) -> torch.Tensor:
        return (-state.token_index.float()).masked_fill(~state.valid, float("inf"))


@pytest.fixture
def registry():
    """The registry, restored after the test."""
    saved = dict(policy_registry.REGISTRY)
    yield policy_registry.REGISTRY
    policy_registry.REGISTRY.clear()
    policy_registry.REGISTRY.update(saved)


def test_registering_one_class_is_all_a_new_policy_takes(registry, tiny_pair):
    from h2o_cli.cli import options
    from h2o_cli.runtime import cache_summary

    register(FirstTokensPolicy)
    assert "first" in policy_names() and options._choice("policy", policy_names)("first") == "first"
    _, model = tiny_pair
    cache = H2OCache(model, CacheSettings(budget=6, policy="first", chunk=3))
    stats = stream_perplexity(model, cache, [list(range(10, 40))], 3)
    assert stats.error is None and stats.tokens == 30
    for store in cache.stores:  # by hand: every chunk's newest entries go, tokens 0..5 stay in every head
        kept = [
            sorted(store.token_index[head][store.valid[head]].tolist()) for head in range(store.n_kv_heads)
        ]
        assert kept == [list(range(6))] * store.n_kv_heads
        assert store.evictions == 24
    summary = cache_summary(cache)
    assert (summary["policy"], summary["heavy"], summary["recent"]) == ("first", 6, 0)


def test_unknown_policy_is_a_usage_error():
    with pytest.raises(UsageError, match="--policy 'lru' is unknown"):
        CacheSettings(budget=8, policy="lru")


@pytest.mark.parametrize(
    ("settings", "heavy", "recent"),
    [
        (dict(policy="h2o", heavy_ratio=0.25), 25, 75),
        (dict(policy="tova", heavy_ratio=0.5), 50, 50),
        (dict(policy="sink", sinks=4), 4, 96),
        (dict(policy="local"), 0, 100),
        (dict(policy="full"), 0, 100),
    ],
)
def test_each_policy_decides_its_slot_split(settings, heavy, recent):
    policy = make_policy(CacheSettings(budget=100, **settings))
    assert (policy.heavy_slots, policy.recent_slots) == (heavy, recent)


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        (dict(policy="h2o", heavy_ratio=1.5), "--heavy-ratio"),
        (dict(policy="tova", heavy_ratio=-0.1), "--heavy-ratio"),
        (dict(policy="h2o", score_norm="max"), "--score-norm"),
        (dict(policy="sink", sinks=8), "--sinks"),
    ],
)
def test_policies_check_their_own_parameters(settings, words):
    with pytest.raises(UsageError, match=words):
        CacheSettings(budget=8, **settings)


def test_full_keeps_its_span_at_original_positions(tiny_pair):
    _, model = tiny_pair
    cache = H2OCache(model, CacheSettings(budget=8, policy="full", chunk=4), span=40)
    assert cache.positions == "original" and cache.stores[0].budget == 40
    assert H2OCache(model, CacheSettings(budget=8, policy="full", chunk=4)).stores[0].budget == 256


def test_name_is_a_class_constant():
    with pytest.raises(TypeError):
        policies.HeavyHitterPolicy(budget=8, name="local")


def test_no_policy_name_is_compared_outside_policies():
    """Code outside h2o_cli/policies/ asks a policy what it can do; it never tests which one it is."""
    names = set(policy_names())
    found = []
    for path in (REPO / "h2o_cli").rglob("*.py"):
        if "policies" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                constants = [
                    element.value
                    for side in [node.left, *node.comparators]
                    for element in (
                        [side] if not isinstance(side, ast.Tuple | ast.List | ast.Set) else side.elts
                    )
                    if isinstance(element, ast.Constant)
                ]
                if names & set(constants):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found
