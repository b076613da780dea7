"""Glue between option values and the library: settings for a loaded model, memory figures."""

from __future__ import annotations

import resource
import sys

from h2o_cli.cache import H2OCache, text_config
from h2o_cli.config import CacheSettings, parse_budget


def context_window(model) -> int:
    return int(text_config(model).max_position_embeddings)


def make_settings(
    model,
    budget: str,
    policy: str = "h2o",
    heavy_ratio: float = 0.5,
    sinks: int = 4,
    positions: str = "rolling",
    score_norm: str = "sum",
    chunk: int = 256,
    kv_bits: int | None = None,
) -> CacheSettings:
    """CacheSettings with `--budget` resolved against the model's context window (SPEC.md)."""
    window = context_window(model)
    tokens = parse_budget(budget, window)
    if policy == "full":
        positions = "original"
        tokens = window
    return CacheSettings(
        budget=tokens,
        policy=policy,
        heavy_ratio=heavy_ratio,
        sinks=sinks,
        positions=positions,
        score_norm=score_norm,
        chunk=chunk,
        kv_bits=kv_bits,
    )


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS).

    The stdlib's getrusage, not psutil: psutil reports peak RSS only on Windows."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def cache_summary(cache: H2OCache) -> dict:
    """Figures about a cache that every command reports the same way (bytes from `h2o_cli.memory`)."""
    from h2o_cli import memory

    settings = cache.settings
    stores = cache.stores
    shape = cache.shape
    dtype_bytes = stores[0].compute_dtype.itemsize
    per_head = memory.h2o_head_bytes(shape, stores[0].slots, settings.kv_bits, dtype_bytes)
    weights = memory.weight_bytes(shape, cache.quant, dtype_bytes) if cache.quant in memory.QUANTS else None
    return {
        "policy": settings.policy,
        "budget_tokens": stores[0].budget,
        "heavy": settings.heavy,
        "recent": settings.recent if settings.policy != "full" else stores[0].budget,
        "sinks": settings.sinks if settings.policy == "sink" else 0,
        "positions": settings.positions,
        "score_norm": settings.score_norm,
        "chunk": settings.chunk,
        "kv_bits": settings.kv_bits,
        "quant": cache.quant,
        "weights_bytes": weights,
        "kv_cache_bytes": per_head * shape.n_layers * shape.n_kv_heads,
        "kv_cache_bytes_per_head": per_head,
        "cached_tokens": cache.length,
        "evictions": stores[0].evictions,
    }
