"""Fused decode attention over the slot cache (Triton). Reference: `h2o_kernels.decode.decode_attention`.

One program per KV head: it rotates the group's queries and every key on the fly (rolling or original
positions from the cos/sin tables), runs an online softmax over key blocks for the output, then a second
pass adds the normalised probabilities (summed over the group) to the scores in place and tracks the
eviction candidate (argmin of the updated score over non-recent valid slots, ties to the oldest token).
A program owns its KV head's slots, so no atomics are needed. Arithmetic is fp32 throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT64_MAX = tl.constexpr(
    2**63 - 1
)  # a Triton global must be a constexpr (real compiler; the interpreter allows any)


@triton.jit
def _rotated(base, rows, row_mask, positions, cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr):
    # x * cos + rotate_half(x) * sin for a [rows, HEAD_DIM] tile; rotate_half(x)[i] = -x[i+h] (i<h), x[i-h].
    dims = tl.arange(0, HEAD_DIM)
    half = HEAD_DIM // 2
    partner = (dims + half) % HEAD_DIM
    sign = tl.where(dims < half, -1.0, 1.0)
    mask = row_mask[:, None]
    x = tl.load(base + rows[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + rows[:, None] * HEAD_DIM + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + positions[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    sin = tl.load(sin_ptr + positions[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    return x * cos + xp * sign[None, :] * sin


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, kpos_ptr, rank_ptr, tok_ptr, cos_ptr, sin_ptr,
    scores_ptr, out_ptr, inc_ptr, cand_ptr,
    query_position, scaling, recent_rank, slots,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    kv = tl.program_id(0)
    heads = tl.arange(0, BLOCK_G)
    head_mask = heads < GROUP
    dims = tl.arange(0, HEAD_DIM)
    qpos = tl.zeros([BLOCK_G], dtype=tl.int64) + query_position
    q = _rotated(q_ptr + kv * GROUP * HEAD_DIM, heads, head_mask, qpos, cos_ptr, sin_ptr, HEAD_DIM)  # [G, d]
    k_base = k_ptr + kv * slots * HEAD_DIM
    v_base = v_ptr + kv * slots * HEAD_DIM
    row = kv * slots
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for start in range(0, slots, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        in_range = offs < slots
        valid = tl.load(valid_ptr + row + offs, mask=in_range, other=0) != 0
        pos = tl.maximum(tl.load(kpos_ptr + row + offs, mask=in_range, other=0), 0)
        k = _rotated(k_base, offs, in_range, pos, cos_ptr, sin_ptr, HEAD_DIM)  # [N, d]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [G, N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing valid yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(v_base + offs[:, None] * HEAD_DIM + dims[None, :], mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(
        out_ptr + (kv * GROUP + heads[:, None]) * HEAD_DIM + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None],
    )
    best_score = tl.full([], float("inf"), tl.float32)
    best_token = tl.full([], INT64_MAX, tl.int64)
    best_slot = tl.full([], -1, tl.int32)
    for start in range(0, slots, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        in_range = offs < slots
        valid = tl.load(valid_ptr + row + offs, mask=in_range, other=0) != 0
        pos = tl.maximum(tl.load(kpos_ptr + row + offs, mask=in_range, other=0), 0)
        k = _rotated(k_base, offs, in_range, pos, cos_ptr, sin_ptr, HEAD_DIM)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling
        p = tl.exp(s - m[:, None]) / l_sum[:, None]
        p = tl.where(valid[None, :] & head_mask[:, None], p, 0.0)
        inc = tl.sum(p, axis=0)  # [N]
        score = tl.load(scores_ptr + row + offs, mask=in_range, other=0.0) + inc
        tl.store(scores_ptr + row + offs, score, mask=in_range)
        tl.store(inc_ptr + row + offs, inc, mask=in_range)
        rank = tl.load(rank_ptr + row + offs, mask=in_range, other=0)
        token = tl.load(tok_ptr + row + offs, mask=in_range, other=0)
        candidate = valid & (rank < recent_rank)
        priority = tl.where(candidate, score, float("inf"))
        low = tl.min(priority, axis=0)
        oldest = tl.min(tl.where(candidate & (priority == low), token, INT64_MAX), axis=0)
        slot = tl.min(tl.where(candidate & (priority == low) & (token == oldest), offs, slots), axis=0)
        better = (low < best_score) | ((low == best_score) & (oldest < best_token))
        better = better & (oldest != INT64_MAX)
        best_score = tl.where(better, low, best_score)
        best_token = tl.where(better, oldest, best_token)
        best_slot = tl.where(better, slot, best_slot)
    tl.store(cand_ptr + kv, best_slot.to(tl.int64))


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    key_positions: torch.Tensor,
    rank: torch.Tensor,
    token_index: torch.Tensor,
    query_position: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    scaling: float,
    scores: torch.Tensor,
    recent_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of `h2o_kernels.decode.decode_attention` (same arguments, same results)."""
    n_heads, head_dim = query.shape
    n_kv_heads, slots = valid.shape
    group = n_heads // n_kv_heads
    output = torch.empty_like(query)
    increments = torch.empty(n_kv_heads, slots, dtype=torch.float32, device=query.device)
    candidate = torch.empty(n_kv_heads, dtype=torch.int64, device=query.device)
    block_n = 64 if head_dim <= 64 else 32
    _decode_kernel[(n_kv_heads,)](
        query.contiguous(), keys, values, valid.view(torch.uint8), key_positions, rank, token_index,
        cos_table, sin_table, scores, output, increments, candidate,
        query_position, scaling, recent_rank, slots,
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=block_n, HEAD_DIM=head_dim,
    )  # fmt: skip
    return output, increments, candidate
