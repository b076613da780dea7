"""A sliding-window layer's cache (`WindowLayer`): the newest `window` tokens, exactly as the model attends.

A model that mixes attention kinds (Gemma 3's `layer_types`) has layers that see only the `window` newest
tokens (each query the tokens `q - window < t <= q`, transformers' `sliding_attention`). Such a layer is
bounded already: it takes no policy, no budget and no archive, keeps the `window - 1` tokens before the next
call (what transformers' own `DynamicSlidingWindowLayer` keeps) and attends each query over its own window,
so it is exact. Its store is a `LayerStore` of `window - 1 + chunk` slots that evicts the oldest entry
(`local`); its slots count in `H2OCache.nbytes` and the report's `window_slots`.

Positions: the layer follows the cache's (`rolling` or `original`). Its entries are always consecutive
tokens, so a rank differs from the token index by one constant per call, and RoPE logits, which depend on
the distance only, are the same either way; rolling ranks stay below `window + chunk` for a text of any
length (docs/design.md, "What positions does a sliding-window layer use?").
"""

from __future__ import annotations

from dataclasses import replace

import torch

from h2o_cli.cache.layer import H2OLayer
from h2o_cli.cache.paths.chunk import ChunkPath
from h2o_cli.cache.report import LayerSlots
from h2o_cli.errors import UsageError


class WindowPath(ChunkPath):
    """Every call into a `WindowLayer`, one-token calls too: the chunk path's body (write, attend, evict),
    each query over the entries of its own window (`WindowLayer.chunk_allowed`); the oldest entry is always
    the one to go, so the scores the body keeps are never read."""

    name = "window"
    in_order = False  # E_q is each query's own window (`WindowLayer.chunk_allowed`)


WINDOW = WindowPath()


class WindowLayer(H2OLayer):
    """A sliding-window decoder layer's cache: its store (`local` on `window - 1` tokens) read by `WindowPath`
    only, at the cache's `positions`, rotated by its own `Rope` (the sliding layers' base)."""

    is_sliding = True
    fused_kernels = False

    def __init__(
        self, store, settings, rope, max_positions: int, window: int, positions: str, **kwargs
    ) -> None:
        super().__init__(store, settings, rope, max_positions, **kwargs)
        self.window = window
        self.positions = positions
        self._step_path = False  # one-token calls stay on `WindowPath` too

    def chunk_allowed(self, chunk: int) -> torch.Tensor:
        """Each query of the chunk just written sees the entries of its own window, `q - window < t <= q`:
        [n_kv_heads, chunk, active] bool."""
        store = self.store
        first_token = store.tokens_seen - chunk
        query_index = torch.arange(first_token, first_token + chunk, device=store.keys.device).view(1, -1, 1)
        distance = query_index - store.token_index[:, : store.active].unsqueeze(1)  # [n_kv, chunk, active]
        return store.allowed(chunk) & (distance < self.window)

    def choose_path(self, states: torch.Tensor) -> WindowPath:
        return WINDOW

    def report(self, recall_slots: int | None = None) -> LayerSlots:
        """`H2OLayer.report`, marked as a window (`LayerSlots.window`)."""
        return replace(super().report(recall_slots), window=True)

    def prepare_fixed(self) -> None:
        raise UsageError(
            "the fixed decode step (--compile) does not take sliding-window layers; run without --compile"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The keys a call attends over: the kept window and the call (the mask transformers builds for a
        sliding layer from this is not read: `WindowPath` masks by token index)."""
        return self.store.length + query_length, 0
