"""Glue between option values and the library: settings for a loaded model, memory figures."""

from __future__ import annotations

import resource
import sys

from h2o_cli.cache import H2OCache
from h2o_cli.cache.families import context_window
from h2o_cli.config import CacheSettings


def make_settings(model, budget: str | float, policy: str = "h2o", **settings) -> CacheSettings:
    """CacheSettings with `--budget` resolved against the model's context window (SPEC.md)."""
    return CacheSettings(budget=budget, policy=policy, **settings).resolved(context_window(model))


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS).

    The stdlib's getrusage, not psutil: psutil reports peak RSS only on Windows."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def cache_summary(cache: H2OCache) -> dict:
    """Figures about a cache that every command reports the same way (bytes from `h2o_cli.memory`)."""
    from h2o_cli import memory
    from h2o_cli.analysis import heavy_slot_stats

    settings = cache.settings
    policy = cache.policy
    stores = cache.stores
    shape = cache.shape
    dtype_bytes = stores[0].compute_dtype.itemsize
    per_head = memory.h2o_head_bytes(shape, stores[0].slots, settings.kv_bits, dtype_bytes)
    weights = memory.weight_bytes(shape, cache.quant, dtype_bytes) if cache.quant in memory.QUANTS else None
    return {
        "policy": settings.policy,
        "budget_tokens": stores[0].budget + policy.recall_slots,  # recall: resident + recalled slots
        "heavy": policy.heavy_slots,
        "recent": stores[0].budget - policy.heavy_slots,
        "sinks": getattr(policy, "sinks", 0),
        "positions": cache.positions,
        "score_norm": settings.score_norm,
        "score_decay": policy.decay_per_query,
        "h2o_sinks": getattr(policy, "h2o_sinks", 0),
        "chunk": settings.chunk,
        "kv_bits": settings.kv_bits,
        "quant": cache.quant,
        "weights_bytes": weights,
        "kv_cache_bytes": per_head * shape.n_layers * shape.n_kv_heads,
        "kv_cache_bytes_per_head": per_head,
        "cached_tokens": cache.length,
        "evictions": stores[0].evictions,
        **cache.archive_summary(),
        **heavy_slot_stats(cache).summary(),  # what the heavy slots hold now (issue 13)
    }
