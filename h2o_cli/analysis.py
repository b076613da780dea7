"""What the heavy slots hold: the age of their tokens, the attention sinks among them, and how much of the
latest attention they still receive. Read from a cache's `layer_slots()`; nothing is changed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from h2o_cli.cache import H2OCache
    from h2o_cli.cache.report import LayerSlots

SINK_TOKENS = 4  # StreamingLLM's attention sinks: the first tokens of the stream


@dataclass(frozen=True)
class HeavySlotStats:
    """One figure per layer (lists of `n_layers` floats; NaN where a layer holds no heavy entry).

    Heavy entries are the kept entries outside the `recent` newest of each KV head (heavy hitters, or the
    sinks of `sink`). The age of an entry is the number of tokens read after it (the newest has age 0).
    - `mean_age`, `median_age`: over the heavy entries of every KV head of the layer.
    - `sinks_kept`: how many of the first `SINK_TOKENS` tokens each KV head still holds, averaged over heads.
    - `heavy_attention`: share of the latest query's attention (summed over its query heads) that lands on
      heavy entries, averaged over KV heads: near 0 means the heavy slots hold tokens nobody attends to now.
    - `heavy_score`, `recent_score`: mean accumulated score of heavy / recent entries (old tokens sit in more
      query rows, so the sum favours them).
    - `heavy_now`, `recent_now`: mean attention one heavy / recent entry gets from the latest query.
    """

    tokens_seen: int
    mean_age: list[float]
    median_age: list[float]
    sinks_kept: list[float]
    heavy_attention: list[float]
    heavy_score: list[float]
    recent_score: list[float]
    heavy_now: list[float]
    recent_now: list[float]

    def summary(self) -> dict[str, float | None]:
        """The figures averaged over layers (None where no layer has heavy entries): what `--json` reports."""

        def mean(values: list[float]) -> float | None:
            finite = [value for value in values if not math.isnan(value)]
            return sum(finite) / len(finite) if finite else None

        return {
            "heavy_mean_age": mean(self.mean_age),
            "heavy_median_age": mean(self.median_age),
            "sinks_kept": mean(self.sinks_kept),
            "heavy_attention_share": mean(self.heavy_attention),
        }

    def as_dict(self) -> dict:
        """Plain data for JSON (NaN as None)."""
        return {
            name: [None if math.isnan(value) else value for value in values]
            if isinstance(values, list)
            else values
            for name, values in asdict(self).items()
        }


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    count = int(mask.sum())
    return float(values[mask].double().sum() / count) if count else float("nan")


def layer_stats(store: LayerSlots, recent_slots: int) -> dict[str, float]:
    """The figures of one layer's slots (`LayerSlots`, or anything with its fields, such as a `LayerStore`)
    whose policy keeps `recent_slots` newest entries per head."""
    valid = store.valid
    token_index = store.token_index
    heavy = valid & (store.rank < store.length - recent_slots)
    recent = valid & ~heavy
    age = (store.tokens_seen - 1 - token_index).double()
    heavy_ages = age[heavy]
    attention = store.last_probs.double()
    total = torch.where(valid, attention, 0.0).sum(dim=1)
    on_heavy = torch.where(heavy, attention, 0.0).sum(dim=1)
    share = (on_heavy / total.clamp_min(1e-30))[total > 0]
    return {
        "mean_age": float(heavy_ages.mean()) if heavy_ages.numel() else float("nan"),
        "median_age": float(heavy_ages.quantile(0.5)) if heavy_ages.numel() else float("nan"),
        "sinks_kept": float((valid & (token_index < SINK_TOKENS)).sum(dim=1).double().mean()),
        "heavy_attention": float(share.mean()) if heavy.any() and share.numel() else float("nan"),
        "heavy_score": _masked_mean(store.scores, heavy),
        "recent_score": _masked_mean(store.scores, recent),
        "heavy_now": _masked_mean(attention, heavy),
        "recent_now": _masked_mean(attention, recent),
    }


def slot_stats(layers: Sequence[LayerSlots], recent_slots: int) -> HeavySlotStats:
    """`HeavySlotStats` of a cache's `layer_slots()` whose policy keeps the `recent_slots` newest entries per
    head (`CacheReport.recent_window`)."""
    figures = [layer_stats(layer, recent_slots) for layer in layers]
    return HeavySlotStats(
        tokens_seen=layers[0].tokens_seen,
        **{name: [layer[name] for layer in figures] for name in figures[0]},
    )


def heavy_slot_stats(cache: H2OCache) -> HeavySlotStats:
    """`HeavySlotStats` of an `H2OCache` (any policy: one without heavy slots gives NaN ages)."""
    return slot_stats(cache.layer_slots(), cache.report().recent_window)
