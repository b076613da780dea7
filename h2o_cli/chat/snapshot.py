"""A cheap, consistent copy of what the cache holds, for the live panel (taken between tokens)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from h2o_cli.cache import H2OCache


@dataclass(frozen=True)
class CacheSnapshot:
    """Per layer x KV head: which token indices are kept and which of them are heavy hitters.

    `token_index`, `heavy`, `scores`: `[n_layers, n_kv_heads, slots]` (token_index -1 = empty slot; `heavy`
    is False there). Recent = rank >= length - recent slots; everything else kept is a heavy hitter. A
    sliding-window layer (`windowed`) holds its window only, all of it recent, in its first `window_slots`
    slots (the rest empty: the global layers' stores are wider).
    With a recalling policy (`recall`), `recalled` `[n_layers, n_kv_heads, recall_slots]` holds the token
    indices each KV head read back from the archive in the last step (-1 = empty slot), and `archive_oldest`
    the oldest token still archived (how far back recall reaches); both None otherwise.
    """

    token_index: torch.Tensor
    heavy: torch.Tensor
    scores: torch.Tensor
    tokens_seen: int
    length: int
    budget: int
    slots: int
    recent: int
    policy: str
    evictions: int
    bytes_per_head: int
    cache_bytes: int
    full_kv_bytes: int
    heavy_summary: dict = field(default_factory=dict)  # `HeavySlotStats.summary()`: ages, sinks, attention
    recalled: torch.Tensor | None = None
    archive_oldest: int | None = None
    pinned: int = 0  # pinned entries per KV head (`H2OCache.pin`; inside `budget`)
    windowed: tuple[bool, ...] = ()  # per layer: attends over a sliding window, beside the budget (Gemma 3)
    window_slots: int = 0  # slots per KV head of a sliding-window layer (0 without them)
    window_bytes_per_head: int = 0  # bytes of one KV head of a sliding-window layer

    def is_window(self, layer: int) -> bool:
        """Whether `layer` attends over a sliding window (its own, not the budget's)."""
        return bool(self.windowed) and self.windowed[layer]

    @property
    def n_layers(self) -> int:
        return self.token_index.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.token_index.shape[1]

    def kept(self, layer: int, head: int) -> tuple[list[int], list[int]]:
        """(heavy token indices, recent token indices) of one KV head, each sorted."""
        index = self.token_index[layer, head]
        valid = index >= 0
        heavy = index[valid & self.heavy[layer, head]].sort().values.tolist()
        recent = index[valid & ~self.heavy[layer, head]].sort().values.tolist()
        return heavy, recent

    def strip(self, layer: int, head: int, width: int) -> list[tuple[int, int]]:
        """Timeline of one KV head in `width` cells over token indices 0..tokens_seen-1.

        Each cell is (heavy tokens kept in its range, recent tokens kept in its range).
        """
        cells = [[0, 0] for _ in range(width)]
        if self.tokens_seen == 0:
            return [tuple(cell) for cell in cells]
        index = self.token_index[layer, head]
        valid = index >= 0
        cell_of = (index.clamp_min(0) * width // max(self.tokens_seen, 1)).clamp_max(width - 1)
        heavy_cells = torch.bincount(cell_of[valid & self.heavy[layer, head]], minlength=width)
        recent_cells = torch.bincount(cell_of[valid & ~self.heavy[layer, head]], minlength=width)
        return list(zip(heavy_cells.tolist(), recent_cells.tolist(), strict=True))

    def strips(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All heads' timelines at once: (heavy, recent) counts per cell, `[n_layers, n_kv_heads, width]`."""
        layers, heads, _ = self.token_index.shape
        valid = self.token_index >= 0
        cell = (self.token_index.clamp_min(0) * width // max(self.tokens_seen, 1)).clamp_max(width - 1)
        row = torch.arange(layers * heads).view(layers, heads, 1) * width
        flat = (row + cell).flatten()
        size = layers * heads * width
        heavy = torch.bincount(flat, weights=(valid & self.heavy).flatten().float(), minlength=size)
        recent = torch.bincount(flat, weights=(valid & ~self.heavy).flatten().float(), minlength=size)
        return heavy.view(layers, heads, width).long(), recent.view(layers, heads, width).long()

    @property
    def recall_slots(self) -> int:
        """Recall slots per KV head (0 without a recalling policy)."""
        return 0 if self.recalled is None else self.recalled.shape[-1]

    def recalled_per_head(self) -> torch.Tensor:
        """Tokens each KV head recalled in the last step, `[n_layers, n_kv_heads]` (zeros without recall)."""
        if self.recalled is None:
            return torch.zeros(self.token_index.shape[:2], dtype=torch.long)
        return (self.recalled >= 0).sum(dim=-1)

    def recall_strips(self, width: int) -> torch.Tensor:
        """Recalled tokens per timeline cell of every head, `[n_layers, n_kv_heads, width]` (as `strips`)."""
        layers, heads, _ = self.token_index.shape
        if self.recalled is None or self.recalled.shape[-1] == 0:
            return torch.zeros(layers, heads, width, dtype=torch.long)
        present = self.recalled >= 0
        cell = (self.recalled.clamp_min(0) * width // max(self.tokens_seen, 1)).clamp_max(width - 1)
        flat = (torch.arange(layers * heads).view(layers, heads, 1) * width + cell).flatten()
        counts = torch.bincount(flat, weights=present.flatten().float(), minlength=layers * heads * width)
        return counts.view(layers, heads, width).long()

    def holds_tokens(self, width: int) -> list[bool]:
        """Which of `width` timeline cells cover at least one token index (fewer tokens than cells leave gaps)."""
        if self.tokens_seen >= width:
            return [True] * width
        cells = torch.arange(self.tokens_seen) * width // max(self.tokens_seen, 1)
        return (torch.bincount(cells, minlength=width) > 0).tolist()

    def top_heavy(self, count: int = 8) -> list[tuple[int, int]]:
        """(token index, number of layer x KV heads keeping it as a heavy hitter), most kept first."""
        index = self.token_index[self.heavy & (self.token_index >= 0)]
        if index.numel() == 0:
            return []
        return Counter(index.tolist()).most_common(count)


def take_snapshot(cache: H2OCache) -> CacheSnapshot:
    """Copy the small per-slot arrays of every layer (not K/V): ~a few hundred microseconds for 30 layers."""
    from h2o_cli.analysis import slot_stats

    report = cache.report()
    layers = cache.layer_slots()
    windowed = tuple(layer.window for layer in layers)
    width = max(layer.token_index.shape[-1] for layer in layers)
    token_index = stacked([layer.token_index for layer in layers], width, -1)
    rank = stacked([layer.rank for layer in layers], width, 0)
    valid = stacked([layer.valid for layer in layers], width, False)
    scores = stacked([layer.scores for layer in layers], width, 0.0).float()
    recent = report.recent_slots
    heavy = valid & (rank < report.length - recent) & ~torch.tensor(windowed).view(-1, 1, 1)
    recalled, archive_oldest = None, None
    if layers[0].recalled is not None:  # recall: the last step's recall slots, and the archive's reach
        recalled = torch.stack([layer.recalled for layer in layers]).cpu()
        archive_oldest = report.archive.archive_oldest
    return CacheSnapshot(
        token_index=torch.where(valid, token_index, -1),
        heavy=heavy,
        scores=scores,
        tokens_seen=report.tokens_seen,
        length=report.length,
        budget=report.resident_slots,
        slots=report.slots,
        recent=min(recent, report.length),
        policy=report.policy,
        evictions=report.evictions,
        bytes_per_head=report.bytes_per_head,
        cache_bytes=report.nbytes,
        full_kv_bytes=report.full_kv_bytes,
        heavy_summary=slot_stats(layers, report.recent_window).summary(),
        recalled=recalled,
        archive_oldest=archive_oldest,
        pinned=report.pinned_slots,
        windowed=windowed if any(windowed) else (),
        window_slots=report.window_slots,
        window_bytes_per_head=report.window_bytes_per_head,
    )


def stacked(per_layer: list[torch.Tensor], width: int, fill) -> torch.Tensor:
    """Layers' `[n_kv_heads, slots]` arrays as one `[n_layers, n_kv_heads, width]` CPU copy, each padded on
    the right with `fill` (a sliding-window layer's store is narrower than a global layer's)."""
    return torch.stack(
        [
            torch.nn.functional.pad(array.cpu(), (0, width - array.shape[-1]), value=fill)
            for array in per_layer
        ]
    )
