"""The two exactness anchors of `recall` (docs/spec.md) on the embedded model, logit for logit."""

from __future__ import annotations

import pytest
import torch

from h2o_cli.cache import H2OCache
from h2o_cli.cache.attention import enable
from h2o_cli.config import CacheSettings
from h2o_cli.streaming import forward_chunk

TOKENS, CHUNK = 300, 32


def through_cache(model, cache: H2OCache, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of `ids` fed `CHUNK` at a time."""
    with torch.no_grad():
        return torch.cat([forward_chunk(model, cache, ids[s : s + CHUNK]) for s in range(0, len(ids), CHUNK)])


@pytest.mark.parametrize("lead_text", [False, True])
@pytest.mark.parametrize("positions", ["rolling", "original"])
def test_recall_with_room_for_every_token_equals_plain_transformers(smollm, excerpt, positions, lead_text):
    """r = 160 recall slots cover every token S (160) has evicted in a 300-token stream, so E_q is every token
    <= q: the logits are plain transformers' (sdpa, its own cache, one forward over the whole text); with
    `--lead-text` too (the lead's pages are taken until every head's slots are full)."""
    model, tokenizer = smollm
    ids = tokenizer(excerpt)["input_ids"][:TOKENS]
    settings = CacheSettings(
        budget=320, policy="recall", chunk=CHUNK, positions=positions, lead_text=lead_text, recall_ratio=0.5
    )
    cache = H2OCache(model, settings)
    got = through_cache(model, cache, ids)
    summary = cache.archive_summary()
    assert cache.length == 160 and summary.recalled_per_step > 0  # evicted, then recalled
    assert summary.lead_text is lead_text  # the embedded model's calibrated lead leads the text
    last_call = (TOKENS - 1) // CHUNK * CHUNK  # its first token: every older token not in S was recalled
    for layer in cache.layers:
        assert (layer.recall_index >= 0).sum(dim=1).eq(last_call - 160).all()
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
    finally:
        enable(model)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_recall_without_recall_slots_equals_h2o(smollm, excerpt):
    """r = 0: the same logits, kept tokens and scores as `h2o` with the same budget and heavy/recent split."""
    model, tokenizer = smollm
    ids = tokenizer(excerpt)["input_ids"][:TOKENS]
    caches = [
        H2OCache(
            model, CacheSettings(budget=64, policy=policy, chunk=CHUNK, heavy_ratio=0.25, recall_ratio=0.0)
        )
        for policy in ("h2o", "recall")
    ]
    h2o_logits, recall_logits = (through_cache(model, cache, ids) for cache in caches)
    assert caches[1].policy.recall_slots == 0 and caches[1].policy.heavy_slots == 16
    torch.testing.assert_close(recall_logits, h2o_logits, rtol=1e-4, atol=1e-4)
    for h2o_store, recall_store in zip(caches[0].stores, caches[1].stores, strict=True):
        assert h2o_store.evictions == recall_store.evictions == TOKENS - 64
        assert torch.equal(h2o_store.token_index, recall_store.token_index)
        torch.testing.assert_close(recall_store.scores, h2o_store.scores, rtol=1e-4, atol=1e-5)
