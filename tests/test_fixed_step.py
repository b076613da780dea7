"""The fixed decode step (h2o_cli.cache.fixed_step): one token in fixed shapes, read from tensors only, against
the naive simulation (tests/naive.py) for every policy setting, and `PageArchive.choose_fixed` against
`choose`. The captured forward of a whole model is tests/test_compiled_step.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import feed_against_naive, feed_chunk
from test_eviction import SETTINGS, make_layer
from test_recall import HEAD_DIM, N_HEADS, N_KV, make_recall_layer, naive_settings

from h2o_cli.cache import H2OLayer
from h2o_cli.config import CacheSettings


class FixedSteps:
    """A layer whose one-token calls take the fixed step (as `H2OCache.fixed_step` switches it on), its
    Python counters advanced after each; longer calls take the layer's own path."""

    def __init__(self, layer: H2OLayer) -> None:
        layer.prepare_fixed()
        self.layer, self.store, self.rope = layer, layer.store, layer.rope
        self.steps = 0

    def update(self, keys, values, kwargs):
        self.layer.fixed = keys.shape[2] == 1
        return self.layer.update(keys, values, kwargs=kwargs)

    def attend(self, query, scaling):
        output = self.layer.attend(query, scaling)
        if self.layer.fixed:
            self.layer.fixed = False
            self.layer.stepped_fixed()
            self.steps += 1
        return output


def counters_match_the_tensors(store) -> None:
    """The Python counters the fixed step advances without reading anything back are the tensors' truth."""
    assert (store.valid.sum(dim=1) == store.length).all()
    assert int(store.token_index.max()) < store.tokens_seen
    assert not store.valid[:, store.active :].any()


@pytest.mark.parametrize("overrides", SETTINGS, ids=lambda o: "-".join(str(v) for v in o.values()))
@pytest.mark.parametrize("chunks", [[1] * 40, [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6]], ids=["decode", "chunked"])
def test_fixed_step_matches_the_naive_simulation(overrides, chunks):
    """From an empty cache (every step in the same shapes as a full cache's) and after chunks that leave holes
    below `active`: outputs and kept sets as docs/spec.md says, counters exact."""
    torch.manual_seed(1)
    settings = CacheSettings(budget=8, chunk=9, **overrides)
    layer, inv_freq = make_layer(settings)
    fixed = FixedSteps(layer)
    feed_against_naive(fixed, settings, inv_freq, chunks, N_HEADS, counters_match_the_tensors)
    assert fixed.steps == chunks.count(1)
    if settings.policy != "full":
        assert layer.store.length == settings.budget
        assert layer.store.evictions == sum(chunks) - settings.budget


@pytest.mark.parametrize(
    "positions, page_score", [("rolling", "positional"), ("rolling", "unrotated"), ("original", "unrotated")]
)
@pytest.mark.parametrize("ratio", [0.5, 0.75])
@pytest.mark.parametrize("chunks", [[1] * 40, [9, 9, 5] + [1] * 30], ids=["decode", "after-chunks"])
def test_fixed_recall_step_matches_the_naive_simulation(positions, page_score, ratio, chunks):
    """The recall step from tensors only: outputs, resident sets, recalled tokens per docs/spec.md; the ring
    wraps (archive of 30 tokens) and the statistics count what the torch step counts."""
    torch.manual_seed(12)
    settings = naive_settings(positions, ratio, archive_max=96, page_score=page_score)
    layer, inv_freq = make_recall_layer(settings)
    fixed = FixedSteps(layer)
    feed_against_naive(fixed, settings, inv_freq, chunks, N_HEADS, counters_match_the_tensors)
    assert layer.archive.tokens == sum(chunks) and layer.steps == len(chunks)
    assert layer.recalled == layer.policy.recall_slots  # the last step filled every slot


@pytest.mark.parametrize("chunks", [[1] * 40, [9, 9, 5] + [1] * 30], ids=["decode", "after-chunks"])
@pytest.mark.parametrize(
    "score",
    [
        {},
        {"page_score": "attention", "shortlist": 3, "page_carry": 0.9},
        {"page_score": "attention", "shortlist": 5, "step_shortlist": 2, "page_carry": 0.9},
        {"page_score": "attention", "shortlist": 3, "page_carry": 0.9, "recall_place": "contiguous"},
    ],
    ids=["bound", "attention", "step-shortlist", "contiguous"],
)
def test_fixed_recall_step_with_blocks_matches_the_naive_simulation(chunks, score):
    """Pages of 6 ranked by their best block of 2 (or by attention mass inside the 3 pages bounded best), from
    tensors only (the block summaries written by index)."""
    torch.manual_seed(13)
    settings = dataclasses.replace(
        naive_settings("rolling", 0.75, archive_max=96), page_size=6, block_size=2, **score
    )
    layer, inv_freq = make_recall_layer(settings)
    fixed = FixedSteps(layer)
    feed_against_naive(fixed, settings, inv_freq, chunks, N_HEADS, counters_match_the_tensors)
    assert layer.recalled == layer.policy.recall_slots


def test_fixed_recall_step_equals_the_torch_step_past_the_archive_cap():
    """With a ring of 30 tokens (pages dropped, which the naive simulation has not): the same outputs,
    recalled tokens and statistics as the torch step, step by step."""
    settings = naive_settings("rolling", 0.5, archive_max=30)
    mine, _ = make_recall_layer(settings)
    theirs, _ = make_recall_layer(settings)
    fixed = FixedSteps(mine)
    torch.manual_seed(3)
    start = 0
    for chunk in [9] + [1] * 50:
        q = torch.randn(N_HEADS, chunk, HEAD_DIM, dtype=torch.float64) * 2
        k = torch.randn(N_KV, chunk, HEAD_DIM, dtype=torch.float64) * 2
        v = torch.randn(N_KV, chunk, HEAD_DIM, dtype=torch.float64)
        got, want = feed_chunk(fixed, q, k, v, start), feed_chunk(theirs, q, k, v, start)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32 rotary tables
        assert torch.equal(mine.recall_index, theirs.recall_index)
        assert (mine.recalled, mine.hits, mine.steps) == (theirs.recalled, theirs.hits, theirs.steps)
        start += chunk
    assert mine.archive.oldest > 0 and mine.hits_total > 0
    assert (mine.recalled_total, mine.hits_total) == pytest.approx((theirs.recalled_total, theirs.hits_total))
