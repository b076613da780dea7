"""The cache's side of the C decode step (h2o_kernels.native.step): the buffers one layer's step takes, held
once per layer, and the call that runs it on the layer's `LayerStore` and keeps the store's counters.

The kernel takes addresses and sizes only; which store buffers it takes, in which order, lives here, and so do
the checks that keep it inside them: each buffer's dtype, shape, layout and device, made once per store (real
checks, not `assert`s, which `python -O` removes).
"""

from __future__ import annotations

import enum

import torch
from h2o_kernels import native

from h2o_cli.cache.store import LayerStore

# The store's buffers the C step takes, in its argument order, and the dtype it reads and writes each in.
STORE_BUFFERS = ("keys", "values", "scores", "seen", "last_probs", "token_index", "rank", "valid")
STORE_DTYPES = (torch.float32,) * 5 + (torch.int64, torch.int64, torch.bool)


class KeyPlacement(enum.IntEnum):
    """Where the C step places E_q's keys (step.c's `rolling` argument)."""

    TOKEN_INDEX = 0  # original positions: each entry at its token index
    ROLLING = 1  # rolling positions: each entry at its rank in E_q by token index
    CONTIGUOUS = (
        2  # rolling, with R placed as one block before the recent window (`--recall-place contiguous`)
    )


def checked(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor` if C code may take it as a contiguous CPU buffer of `shape` in `dtype`; else raises ValueError
    (C code given anything else would read or write past it)."""
    if (
        tensor.dtype != dtype
        or tuple(tensor.shape) != tuple(shape)
        or not tensor.is_contiguous()
        or tensor.device.type != "cpu"
    ):
        raise ValueError(
            f"the C step cannot take {name}: want a contiguous CPU {dtype} {list(shape)}, got "
            f"{'a contiguous' if tensor.is_contiguous() else 'a strided'} {tensor.device.type} {tensor.dtype} "
            f"{list(tensor.shape)}"
        )
    return tensor


def store_pointers(store: LayerStore) -> tuple[int, ...]:
    """The addresses of a float32 CPU store's buffers (`STORE_BUFFERS`), in the C step's argument order, each
    checked (`checked`): they never move, so they are taken once per store."""
    slots = (store.n_kv_heads, store.slots)
    shapes = {"keys": (*slots, store.head_dim), "values": (*slots, store.head_dim)}  # the others: `slots`
    buffers = zip(STORE_BUFFERS, STORE_DTYPES, strict=True)
    return tuple(
        checked(f"the store's {name}", getattr(store, name), dtype, shapes.get(name, slots)).data_ptr()
        for name, dtype in buffers
    )


class CStep:
    """One layer's C step over its store (S; R = ∅, `h2o`'s step): the store's buffer addresses, the scratch
    (sized at the first call for its query heads per KV head) and the evicted slots."""

    recall = 0  # recall slots per KV head the scratch makes room for

    def __init__(self, store: LayerStore) -> None:
        self.store = store
        self.pointers = store_pointers(store)
        self.victims = torch.empty(store.n_kv_heads, dtype=torch.int64)
        self.pinned = checked(
            "the store's pinned", store.pinned, torch.bool, tuple(store.valid.shape)
        ).data_ptr()
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
            self.pinned if store.pinned_count else None,
        )  # fmt: skip
        store.stepped(active)
        return output
