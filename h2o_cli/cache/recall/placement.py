"""Where a `recall` layer's recalled tokens R sit among its resident ones S (`--recall-place`, docs/spec.md:
recall, placement): the rolling ranks of E_q = S ∪ R for a chunk, and S ∪ R in rank order for the read."""

from __future__ import annotations

import torch
from h2o_kernels.reference import OLDEST_LAST

from h2o_cli.cache.c_step import KeyPlacement
from h2o_cli.cache.paths.base import Recalled
from h2o_cli.cache.positions import placed_order, rolling_positions


class RecallPlacement:
    """`RecallLayer`'s positional hooks (a mixin before `H2OLayer`): it reads `store`, `recall_index`,
    `policy` and `positions` of the layer."""

    @property
    def placement(self) -> KeyPlacement:
        rolling_contiguous = self._contiguous and self.positions == "rolling"
        return KeyPlacement.CONTIGUOUS if rolling_contiguous else super().placement

    def chunk_positions(self, chunk: int, recalled: Recalled | None) -> tuple[torch.Tensor, int]:
        """E_q = S ∪ R ∪ {chunk tokens <= q}: rolling ranks by token index (every head's queries at one
        position) or token indices, S's `active` slots then R's."""
        store = self.store
        first = store.tokens_seen - chunk
        token_index = torch.cat([store.token_index[:, : store.active], self.recall_index], dim=1)
        if self.positions != "rolling":
            return token_index.clamp_min(0), first
        key_positions, entries = rolling_positions(self._placed(token_index, first), token_index >= 0)
        return key_positions, entries - chunk

    def merged_order(self, chunk: int) -> torch.Tensor | None:
        """The columns of [S's first `active` slots, R] sorted by what `chunk_positions` ranks them by, when
        every recall slot holds a token and positions roll: every head then has length + r entries, so the
        ranks are 0 .. n-1 and the chunk's tokens, the newest, come last. None otherwise."""
        store, recall_index = self.store, self.recall_index
        if self.positions != "rolling" or not bool((recall_index >= 0).all()):
            return None
        token_index = torch.cat([store.token_index[:, : store.active], recall_index], dim=1)
        key = self._placed(token_index, store.tokens_seen - chunk)
        if store.active > store.length:  # S's holes: ranked last, then cut
            key[:, : store.active].masked_fill_(~store.valid[:, : store.active], OLDEST_LAST)
        return torch.sort(key, dim=1).indices[:, : store.length + recall_index.shape[1]]

    @property
    def _contiguous(self) -> bool:
        """Whether rolling positions place R as one block before the recent window (`--recall-place`)."""
        return self.policy.recall_place == "contiguous" and self.recall_index.shape[1] > 0

    def _recent_from(self, first: int | torch.Tensor) -> int | torch.Tensor:
        """The oldest token of the block R is placed before, for a call whose first token is `first`: a step's
        recent window (its `recent_slots` newest tokens, at least its own), and for a chunk the same window's
        older tokens and the whole chunk. The C step's split (`limit`, at most |S| - 1) is the same block."""
        return first - max(self.policy.recent_slots, 1) + 1

    def _placed(self, token_index: torch.Tensor, first: int | torch.Tensor) -> torch.Tensor:
        """What `rolling_positions` ranks E_q by for a call whose first token is `first`: the token indices
        [n_kv_heads, |S| + r] (R's `r` columns last), or under `--recall-place contiguous` `placed_order`'s key
        with R before `_recent_from(first)`."""
        if not self._contiguous:
            return token_index
        return placed_order(token_index, self.recall_index.shape[1], self._recent_from(first))
