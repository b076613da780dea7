import weakref

import torch

from h2o_cli import streaming
from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings


def test_no_chunk_logits_outlive_their_chunk(tiny_pair, monkeypatch):
    """Regression: `previous` was a view of the whole [chunk, vocab] log-probs, keeping it alive through the
    next chunk's forward pass. Every chunk-sized tensor must be gone when the next chunk starts."""
    _, model = tiny_pair
    alive = []
    real_forward, real_log_softmax = streaming.forward_chunk, torch.log_softmax

    def forward(model, cache, ids):
        assert all(ref() is None for ref in alive), "a previous chunk's [chunk, vocab] tensor is still alive"
        logits = real_forward(model, cache, ids)
        alive.append(weakref.ref(logits))
        return logits

    def log_softmax(tensor, *args, **kwargs):
        result = real_log_softmax(tensor, *args, **kwargs)
        alive.append(weakref.ref(result))
        return result

    monkeypatch.setattr(streaming, "forward_chunk", forward)
    monkeypatch.setattr(torch, "log_softmax", log_softmax)
    ids = list(range(3, 60))
    cache = H2OCache(model, CacheSettings(budget=16, chunk=8))
    stats = streaming.stream_perplexity(model, cache, [ids], 8)
    assert stats.error is None and stats.predictions == len(ids) - 1 and len(alive) == 16
