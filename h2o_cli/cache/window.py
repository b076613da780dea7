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

import torch
from h2o_kernels import slot_attention
from h2o_kernels.reference import rows

from h2o_cli.cache.layer import H2OLayer
from h2o_cli.cache.paths.chunk import ChunkPath
from h2o_cli.errors import UsageError


class WindowPath(ChunkPath):
    """Every call into a `WindowLayer`: the chunk path's sub-chunks (write, attend, evict), each query over
    the entries of its own window, without scores (the oldest entry is always the one to go)."""

    name = "window"

    def attend_written(self, layer, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attend the chunk just written (query [n_heads, chunk, head_dim], unrotated) over the window of each
        query, then keep the newest `window - 1` entries. Returns [1, chunk, n_heads, head_dim]."""
        chunk, store = query.shape[1], layer.store
        active = store.active
        key_positions, first_query_position = layer.chunk_positions(chunk, None)
        first_token = store.tokens_seen - chunk
        query_index = torch.arange(first_token, first_token + chunk, device=query.device).view(1, -1, 1)
        distance = query_index - store.token_index[:, :active].unsqueeze(1)  # [n_kv, chunk, active]
        allowed = store.allowed(chunk) & (distance < layer.window)
        cos_table, sin_table = layer.rope.table(first_query_position + chunk, query.dtype, query.device)
        query_positions = slice(first_query_position, first_query_position + chunk)
        output, _, _ = slot_attention(
            query,
            store.key_states(active),
            store.value_states(active),
            allowed,
            cos_table[query_positions],
            sin_table[query_positions],
            rows(cos_table, key_positions),
            rows(sin_table, key_positions),
            scaling,
        )
        store.evict(layer.policy)
        return output.transpose(0, 1).unsqueeze(0)


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

    def choose_path(self, states: torch.Tensor) -> WindowPath:
        return WINDOW

    def prepare_fixed(self) -> None:
        raise UsageError(
            "the fixed decode step (--compile) does not take sliding-window layers; run without --compile"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The keys a call attends over: the kept window and the call (the mask transformers builds for a
        sliding layer from this is not read: `WindowPath` masks by token index)."""
        return self.store.length + query_length, 0
