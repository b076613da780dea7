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
    from h2o_cli.analysis import slot_stats

    report = cache.report()
    settings, shape = report.settings, report.shape
    dtype_bytes = report.compute_bytes
    per_head = memory.h2o_head_bytes(shape, report.slots, settings.kv_bits, dtype_bytes)
    weights = memory.weight_bytes(shape, report.quant, dtype_bytes) if report.quant in memory.QUANTS else None
    return {
        "policy": report.policy,
        "budget_tokens": report.budget_tokens,  # recall: resident + recalled slots
        "heavy": report.heavy_slots,
        "recent": report.recent_slots,
        "sinks": report.sinks,
        "positions": report.positions,
        "score_norm": settings.score_norm,
        "score_decay": report.score_decay,
        "h2o_sinks": report.h2o_sinks,
        "chunk": settings.chunk,
        "kv_bits": settings.kv_bits,
        "quant": report.quant,
        "weights_bytes": weights,
        "kv_cache_bytes": memory.h2o_cache_bytes(
            shape, report.slots - settings.chunk, settings.chunk, settings.kv_bits, dtype_bytes
        ),
        "kv_cache_bytes_per_head": per_head,
        "cached_tokens": report.length,
        "evictions": report.evictions,
        **report.window_row,
        **report.archive_row,
        **slot_stats(cache.layer_slots(), report.recent_window).summary(),  # what the heavy slots hold now
    }
