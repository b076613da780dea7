"""The cache's side of the C decode step (h2o_kernels.native.step): the buffers one layer's step takes, held
once per layer, and the call that runs it on the layer's `LayerStore` and keeps the store's counters.

The kernel takes addresses and sizes only; which store buffers it takes, in which order, lives here.
"""

from __future__ import annotations

import enum

import torch
from h2o_kernels import native

from h2o_cli.cache.store import LayerStore

# The store's buffers the C step takes, in its argument order.
STORE_BUFFERS = ("keys", "values", "scores", "seen", "last_probs", "token_index", "rank", "valid")


class KeyPlacement(enum.IntEnum):
    """Where the C step places E_q's keys (step.c's `rolling` argument)."""

    TOKEN_INDEX = 0  # original positions: each entry at its token index
    ROLLING = 1  # rolling positions: each entry at its rank in E_q by token index
    CONTIGUOUS = (
        2  # rolling, with R placed as one block before the recent window (`--recall-place contiguous`)
    )


def store_pointers(store: LayerStore) -> tuple[int, ...]:
    """The addresses of a float32 CPU store's buffers (`STORE_BUFFERS`), in the C step's argument order: they
    never move, so they are taken once per store."""
    buffers = [getattr(store, name) for name in STORE_BUFFERS]
    assert all(tensor.is_contiguous() and tensor.device.type == "cpu" for tensor in buffers)
    assert store.keys.dtype == torch.float32
    return tuple(tensor.data_ptr() for tensor in buffers)


class CStep:
    """One layer's C step over its store (S; R = ∅, `h2o`'s step): the store's buffer addresses, the scratch
    (sized at the first call for its query heads per KV head) and the evicted slots."""

    recall = 0  # recall slots per KV head the scratch makes room for

    def __init__(self, store: LayerStore) -> None:
        self.store = store
        self.pointers = store_pointers(store)
        self.victims = torch.empty(store.n_kv_heads, dtype=torch.int64)
        self.group = 0
        self.scratch = torch.empty(0, dtype=torch.float32)

    def _scratch(self, group: int) -> torch.Tensor:
        """The float scratch for `group` query heads per KV head: their probabilities over S and the recall
        slots, one key row and the query halves (step.c's layout); made once."""
        if self.group != group:
            store = self.store
            size = group * (store.slots + self.recall) + (group + 1) * store.head_dim
            self.scratch = torch.empty(size, dtype=torch.float32)
            self.group = group
        return self.scratch

    def run(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        table: torch.Tensor,
        rolling: int,
        limit: int,
        decay: float,
        recall: tuple = native.NO_RECALL,
        entries: int | None = None,
    ) -> torch.Tensor:
        """The step (`native.step`: the arguments as there) on this store; takes its result into the store's
        counters. Returns the output [n_kv_heads, group, head_dim] float32."""
        store = self.store
        scratch = self.scratch if query.shape[1] == self.group else self._scratch(query.shape[1])
        output, active = native.step(
            query, key, value, table, self.pointers, store.slots, store.active, rolling, store.tokens_seen,
            store.length, limit, decay, scratch, self.victims, recall, entries,
        )  # fmt: skip
        store.stepped(active)
        return output
