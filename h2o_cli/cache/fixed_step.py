"""The fixed decode step: one token in fixed shapes, read from tensors only, so that a whole one-token forward
can be captured once (torch.compile with `fullgraph=True`, CUDA graphs) and replayed (h2o_cli.compiled).

The torch step (h2o_cli.cache.step) and the C step take their sizes and positions from the store's Python
counters (`length`, `active`, `tokens_seen`), which is what makes them cheap on the CPU and what a captured
graph cannot do: each Python value read would be baked into the graph (a recompile each step), and each
tensor read back to Python is a host sync. The fixed step computes the same thing from tensors alone:
- the token index is the model's `position_ids` (a tensor the caller passes), the entries per head are
  `valid.sum()`, the query's rolling position is that count: no counter is read;
- it attends over every slot of the store (`budget + chunk`), the empty ones masked out of the softmax, so
  no shape depends on how full the cache is (the same graph while the cache fills and once it is full);
- the victim is the policy's rule over all slots, and it is dropped only where the head holds more than
  `budget` entries (`LayerStore.drop_fixed`, a select, not a branch);
- the RoPE tables are sized once, for the largest position the cache can reach (`H2OCache.fix_steps`).
The Python counters then advance by what they imply (`LayerStore.stepped_fixed`, called by
`H2OCache.fixed_step` after the forward): every figure `report()` gives stays exact, with no read-back.
The results are the torch step's to float rounding (the layer tests compare them token by token).

A 16-bit model (bfloat16 / float16, as on a GPU) takes it too, though not the torch or C step: its K/V stay in
16 bits in the store, as do the RoPE tables (the chunk path's), and the step computes in float32 (`step_dtype`):
the slots and table rows it reads are upcast, the query·key products, the softmax, the score increments and
the value sum are float32, and the output is cast back to the model's dtype.
"""

from __future__ import annotations

import torch

from h2o_cli.cache.positions import rotate, unrotate
from h2o_cli.cache.step import expand
from h2o_cli.cache.store import LayerStore

# The compute dtypes the fixed step takes (`H2OCache.fix_steps` refuses others); 16-bit ones in float32.
FIXED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def step_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the fixed step computes in for a store computing in `compute_dtype`: float32 for 16 bits,
    else `compute_dtype` itself (float32, float64)."""
    return torch.promote_types(compute_dtype, torch.float32)


def fixed_query(
    query: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    position: torch.Tensor,
    scaling: float,
    n_kv_heads: int,
) -> torch.Tensor:
    """The model's query [1, n_heads, 1, head_dim] (rotated at `cos`, `sin` [1, head_dim]) unrotated, rotated at
    its cache position (`position` [1] int64, a row of `cos_table`, `sin_table` [rows, head_dim]) and scaled:
    [n_kv_heads, group, 2 * head_dim] in `expand`'s form, as `step_attention` takes it (`DecodeMaps.query`'s
    map, applied elementwise), in `step_dtype` of the tables' dtype."""
    dtype = step_dtype(cos_table.dtype)
    cos_row = cos_table.index_select(0, position).to(dtype)
    sin_row = sin_table.index_select(0, position).to(dtype)
    rotated = rotate(unrotate(query[0, :, 0].to(dtype), cos.to(dtype), sin.to(dtype)), cos_row, sin_row)
    return (expand(rotated) * scaling).view(n_kv_heads, -1, 2 * query.shape[-1])


def accumulate_fixed(store: LayerStore, increments: torch.Tensor, decay: float) -> None:
    """`LayerStore.accumulate` of one query over every slot: increments [n_kv_heads, slots] (0 where empty)."""
    if decay != 1.0:
        store.scores.mul_(decay)
    store.scores.add_(increments)
    store.last_probs.copy_(increments)
    store.seen.add_(store.valid)
