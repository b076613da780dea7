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
    )


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def cache_summary(cache: H2OCache) -> dict:
    """Figures about a cache that every command reports the same way."""
    settings = cache.settings
    stores = cache.stores
    per_head = stores[0].nbytes() // stores[0].n_kv_heads
    return {
        "policy": settings.policy,
        "budget_tokens": stores[0].budget,
        "heavy": settings.heavy,
        "recent": settings.recent if settings.policy != "full" else stores[0].budget,
        "sinks": settings.sinks if settings.policy == "sink" else 0,
        "positions": settings.positions,
        "score_norm": settings.score_norm,
        "chunk": settings.chunk,
        "kv_cache_bytes": cache.nbytes(),
        "kv_cache_bytes_per_head": per_head,
        "cached_tokens": cache.length,
        "evictions": stores[0].evictions,
    }
