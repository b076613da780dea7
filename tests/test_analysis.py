"""Heavy-slot figures against values computed by hand and against what a policy guarantees."""

from __future__ import annotations

import math

import pytest
import torch

from h2o_cli.analysis import heavy_slot_stats, layer_stats
from h2o_cli.cache import H2OCache
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings


def test_layer_figures_by_hand():
    """Two KV heads keep tokens {0, 3 | 6, 7} and {4, 5 | 6, 7} (heavy | recent) of 8 read."""
    store = LayerStore(2, 4, budget=4, chunk=4, dtype=torch.float32, device=torch.device("cpu"))
    store.write(torch.zeros(2, 8, 4), torch.zeros(2, 8, 4))  # tokens 0..7 in slots 0..7
    store.drop(torch.tensor([[1, 2, 4, 5], [0, 1, 2, 3]]))
    store.last_probs[0] = torch.tensor([0.5, 0, 0, 0.1, 0, 0, 0.2, 0.2])
    store.last_probs[1] = torch.tensor([0, 0, 0, 0, 0.1, 0.1, 0.4, 0.4])
    store.scores[0] = torch.tensor([3.0, 0, 0, 1.0, 0, 0, 0.5, 0.5])
    store.scores[1] = torch.tensor([0, 0, 0, 0, 2.0, 2.0, 1.0, 0.0])
    got = layer_stats(store, recent_slots=2)
    # Ages 7 - t: heavy entries 0, 3 | 4, 5 -> 7, 4, 3, 2.
    assert got["mean_age"] == pytest.approx(4.0)
    assert got["median_age"] == pytest.approx(3.5)
    assert got["sinks_kept"] == pytest.approx(1.0)  # head 0 holds tokens 0 and 3, head 1 none of 0..3
    assert got["heavy_attention"] == pytest.approx((0.6 / 1.0 + 0.2 / 1.0) / 2)
    assert got["heavy_now"] == pytest.approx(0.8 / 4)
    assert got["recent_now"] == pytest.approx(1.2 / 4)
    assert got["heavy_score"] == pytest.approx(8.0 / 4)
    assert got["recent_score"] == pytest.approx(2.0 / 4)


def _streamed(model, **settings) -> H2OCache:
    cache = H2OCache(model, CacheSettings(budget=16, chunk=8, **settings))
    ids = torch.randint(0, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for start in range(0, 60, 8):
            model(input_ids=ids[:, start : start + 8], cache=cache, use_cache=True)
    return cache


def test_sink_policy_holds_its_sinks_in_the_heavy_slots(tiny_pair):
    """`sink` with 4 sinks: the heavy entries are tokens 0..3 in every layer, ages 59..56."""
    stats = heavy_slot_stats(_streamed(tiny_pair[1], policy="sink", sinks=4))
    assert stats.tokens_seen == 60
    assert stats.sinks_kept == [4.0, 4.0]
    assert stats.mean_age == [pytest.approx(57.5)] * 2
    summary = stats.summary()
    assert summary["heavy_mean_age"] == pytest.approx(57.5) and summary["sinks_kept"] == 4.0
    assert 0 < summary["heavy_attention_share"] < 1


def test_window_policy_has_no_heavy_entries(tiny_pair):
    stats = heavy_slot_stats(_streamed(tiny_pair[1], policy="local"))
    assert all(math.isnan(age) for age in stats.mean_age)
    assert stats.summary()["heavy_mean_age"] is None
    assert stats.sinks_kept == [0.0, 0.0]  # 60 tokens read, a 16-token window


def test_h2o_sinks_are_held_and_counted(tiny_pair):
    stats = heavy_slot_stats(_streamed(tiny_pair[1], policy="h2o", h2o_sinks=3))
    assert all(kept >= 3.0 for kept in stats.sinks_kept)
    # Heavy entries are older than the recent window (8 newest: ages 0..7).
    assert all(age > 7 for age in stats.mean_age)
