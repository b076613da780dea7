"""Pure-torch attention over the slot cache; the reference every kernel is tested against, and the CPU path."""

from __future__ import annotations

import functools
import math

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE rotation in the `rotate_half` convention (cos, sin broadcast against x's last dims):
    `x * cos + rotate_half(x) * sin`, the same operations on the same values."""
    half = x.shape[-1] // 2
    rotated = x * cos
    turned = torch.empty_like(x)  # rotate_half(x) = [-x2, x1], written in place: no neg/cat temporaries
    torch.neg(x[..., half:], out=turned[..., :half])
    turned[..., half:] = x[..., :half]
    if rotated.shape != x.shape or rotated.dtype != x.dtype:  # cos/sin widen x: no in-place reuse
        return rotated + turned * sin
    return rotated.add_(turned.mul_(sin))


def rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`table[positions]` ([n, d] table, integer positions of any shape) by one `index_select`: the same
    values, ~5x cheaper on CPU than advanced indexing for a step's [n_kv_heads, slots] positions."""
    return table.index_select(0, positions.reshape(-1)).view(*positions.shape, table.shape[-1])


def slot_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor | None,
    query_cos: torch.Tensor,
    query_sin: torch.Tensor,
    key_cos: torch.Tensor,
    key_sin: torch.Tensor,
    scaling: float,
    query_weights: torch.Tensor | None = None,
    matmul_dtype: torch.dtype | None = None,
    leading: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact softmax attention of a chunk over the entries each KV head may see.

    query: [n_heads, chunk, head_dim] unrotated; keys, values: [n_kv_heads, slots, head_dim] unrotated.
    allowed: [n_kv_heads, chunk, slots] bool, the set E_q of SPEC.md for each query; or None when the keys are
    in token order and end with the chunk's own `chunk` tokens: every query sees every earlier key and its
    chunk's up to itself (one [chunk, chunk] mask on the last columns instead of one over every column);
    with it, `leading` [n_kv_heads, m] bool may hide some of the first m keys from every query (False: an
    empty slot), None: every key before the chunk is seen.
    query_cos/sin: [chunk, head_dim]; key_cos/sin: [n_kv_heads, slots, head_dim].
    Returns output [n_heads, chunk, head_dim], score increments [n_kv_heads, slots] (probabilities summed over
    the chunk's queries and the query heads of each KV head) and the last query's probabilities
    [n_kv_heads, slots] (summed over query heads). query_weights [chunk] (float32): weigh each query's
    probabilities in the score increments (decayed scores); None = all 1. matmul_dtype (bfloat16 for a read
    under `--dtype auto`): QK^T and PV multiply in it, its products summed in float32 by the matmul; the
    logits, softmax, probabilities and score increments stay float32. None: the inputs' dtype throughout.
    """
    n_heads, chunk, head_dim = query.shape
    n_kv_heads, slots = keys.shape[:2]
    group = n_heads // n_kv_heads
    # [n_kv, group * chunk, d]: the query heads that share each KV head stacked, so one bmm per KV head
    # serves them all (a broadcast matmul over the group would copy the keys group times).
    q = rotate(query, query_cos, query_sin).reshape(n_kv_heads, group * chunk, head_dim)
    k = rotate(keys, key_cos, key_sin)
    # A power-of-two scale (head_dim 64's 1/8) scales q exactly as it would scale the logits, in fewer values;
    # a bf16 matmul takes q scaled before rounding.
    early = math.frexp(scaling)[0] == 0.5 or matmul_dtype is not None
    if early:
        q = q.mul_(scaling)
    if matmul_dtype is not None:
        q, k = q.to(matmul_dtype), k.to(matmul_dtype)
    logits = torch.bmm(q, k.transpose(1, 2))  # [n_kv, group * chunk, slots]
    if matmul_dtype is None:
        logits = logits.float()
    if not early:
        logits = logits.mul_(scaling)
    logits = logits.view(n_kv_heads, group, chunk, slots)
    # The masks add 0 or -inf: exact in any dtype, so a bf16 product is masked before softmax widens it.
    if allowed is None:  # E_q in token order: only the chunk's own columns are masked, causally
        logits[..., slots - chunk :].add_(later_in_chunk(chunk, logits.dtype, logits.device))
        if leading is not None:
            logits[..., : leading.shape[1]].add_(hiding(leading, logits.dtype)[:, None, None, :])
    else:
        logits.add_(hiding(allowed, logits.dtype).unsqueeze(1))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [n_kv, group, chunk, slots]
    weights = probs.view(n_kv_heads, group * chunk, slots)
    if matmul_dtype is None:
        output = torch.bmm(weights.to(values.dtype), values)
    else:
        output = torch.bmm(weights.to(matmul_dtype), values.to(matmul_dtype)).to(values.dtype)
    last_probs = probs[:, :, -1].sum(dim=1)
    if query_weights is not None:
        score_increments = torch.einsum("kgcs,c->ks", probs, query_weights)
    else:
        score_increments = last_probs if chunk == 1 else weights.sum(dim=1)
    return output.view(n_heads, chunk, head_dim), score_increments, last_probs


def hiding(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `seen` (bool), -inf elsewhere, in `dtype`: added to finite logits it is the masked fill bit for
    bit, ~3x faster than a broadcast `masked_fill_`."""
    return torch.where(seen, 0.0, float("-inf")).to(dtype)


@functools.lru_cache(maxsize=8)
def later_in_chunk(chunk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[chunk, chunk]: -inf where query i must not see the chunk's token j > i, else 0 (added to
    `slot_attention`'s last `chunk` columns when `allowed` is None: a masked fill, in one vectorised add).
    Cached: read only, the same for every layer."""
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=device).triu_(1)
    return torch.zeros(chunk, chunk, dtype=dtype, device=device).masked_fill_(later, float("-inf"))


NEVER = float("inf")
OLDEST_LAST = torch.iinfo(torch.int64).max


def lowest_oldest(priority: torch.Tensor, age: torch.Tensor) -> torch.Tensor:
    """The slot to evict per head: the lowest priority, ties to the lowest age (the oldest token).

    priority: [n_kv_heads, n] float (`inf`: never, unless every slot is); age: [n_kv_heads, n] int64, ordered
    as token indices (`OLDEST_LAST` for a slot that may not be chosen). Returns [n_kv_heads, 1] slot indices.
    """
    lowest = priority.min(dim=1, keepdim=True).values
    oldest = torch.where(priority == lowest, age, OLDEST_LAST)
    return oldest.argmin(dim=1, keepdim=True)


def lowest_outside_recent(
    scores: torch.Tensor, rank: torch.Tensor, limit: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """The victim rule of a `kernel_victim` policy: per head, the lowest score among the entries of rank
    < `limit` (`length - recent_slots`: the recent window is protected), ties to the oldest.

    scores, rank: [n_kv_heads, n]; valid: [n_kv_heads, n] bool, the slots that hold an entry (None: every one,
    as in a compacted store's first `active` slots, and then `limit >= 1`). Ranks are dense and ordered by token
    index, so the lowest rank is the oldest token. Returns [n_kv_heads, 1] slot indices; with `valid`, -1 for a
    head with no entry of rank < `limit`. The fused decode kernels (triton_decode.py, the C step's
    `score_and_evict`) are its twins; `select_evictions(policy.priority(...), ..., 1)` is the same choice.
    """
    eligible = rank < limit
    if valid is not None:
        eligible &= valid
    victim = lowest_oldest(torch.where(eligible, scores, NEVER), rank)
    if valid is None:
        return victim
    return torch.where(eligible.any(dim=1, keepdim=True), victim, -1)
