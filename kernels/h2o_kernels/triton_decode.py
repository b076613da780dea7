"""Decode attention over the slot cache, split over the slot axis (Triton). Reference:
`h2o_kernels.decode.decode_attention`.

Flash-decoding's split-K, with H2O's score column on top. The slots of each KV head are cut into `splits`
ranges (`decode_tiles` chooses them), one program per (KV head, range) in two launches:

1. `_partial_kernel`: rotate the group's queries and the range's keys on the fly (rolling or original
   positions from the cos/sin tables), write each logit, and run an online softmax over the range's key
   blocks: a partial max, sum and unnormalised output per query head.
2. `_combine_kernel`: merge every range's max and sum into the global ones (each program redoes this small
   merge), turn its own range's logits into probabilities with them, add the probabilities summed over the
   group to the scores in place (the increments), and find its range's eviction candidate: the lowest
   updated score among valid slots of rank < `recent_rank`, ties to the oldest token. The range-0 program
   also merges the partial outputs. The last program of a KV head to finish (an int32 counter, atomic) picks
   the candidate among the ranges'.

Only the second launch writes the caller's tensors, so a kernel that fails to compile or launch leaves the
scores untouched and the torch path can redo the call. Arithmetic is fp32 throughout; no atomics on floats.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT64_MAX = tl.constexpr(
    2**63 - 1
)  # a Triton global must be a constexpr (real compiler; the interpreter allows any)
PROGRAMS = 264  # about two programs per multiprocessor of an H100/H200 (132)
MAX_SPLITS = 64


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
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, kpos_ptr, cos_ptr, sin_ptr,
    logit_ptr, m_ptr, l_ptr, acc_ptr,
    query_position, scaling, slots, split_size, splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    kv = tl.program_id(0)
    split = tl.program_id(1)
    heads = tl.arange(0, BLOCK_G)
    head_mask = heads < GROUP
    dims = tl.arange(0, HEAD_DIM)
    qpos = tl.zeros([BLOCK_G], dtype=tl.int64) + query_position
    q = _rotated(q_ptr + kv * GROUP * HEAD_DIM, heads, head_mask, qpos, cos_ptr, sin_ptr, HEAD_DIM)  # [G, d]
    k_base = k_ptr + kv * slots * HEAD_DIM
    v_base = v_ptr + kv * slots * HEAD_DIM
    row = kv * slots
    logit_base = logit_ptr + kv * BLOCK_G * slots
    first = split * split_size
    end = tl.minimum(first + split_size, slots)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for start in range(first, end, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        in_range = offs < end
        valid = tl.load(valid_ptr + row + offs, mask=in_range, other=0) != 0
        pos = tl.maximum(tl.load(kpos_ptr + row + offs, mask=in_range, other=0), 0)
        k = _rotated(k_base, offs, in_range, pos, cos_ptr, sin_ptr, HEAD_DIM)  # [N, d]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [G, N]
        s = tl.where(valid[None, :], s, float("-inf"))
        tl.store(logit_base + heads[:, None] * slots + offs[None, :], s, mask=in_range[None, :])
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing valid yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(v_base + offs[:, None] * HEAD_DIM + dims[None, :], mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    part = (kv * splits + split) * BLOCK_G + heads
    tl.store(m_ptr + part, m)
    tl.store(l_ptr + part, l_sum)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc)


@triton.jit
def _combine_kernel(
    logit_ptr, m_ptr, l_ptr, acc_ptr, valid_ptr, rank_ptr, tok_ptr,
    scores_ptr, out_ptr, inc_ptr, best_score_ptr, best_token_ptr, best_slot_ptr, done_ptr, cand_ptr,
    recent_rank, slots, split_size, splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    kv = tl.program_id(0)
    split = tl.program_id(1)
    heads = tl.arange(0, BLOCK_G)
    head_mask = heads < GROUP
    dims = tl.arange(0, HEAD_DIM)
    parts = tl.arange(0, BLOCK_S)
    part_mask = parts < splits
    # the global max and sum of each query head, from every range's partial ones
    part_index = (kv * splits + parts[:, None]) * BLOCK_G + heads[None, :]  # [S, G]
    m_parts = tl.load(m_ptr + part_index, mask=part_mask[:, None], other=float("-inf"))
    l_parts = tl.load(l_ptr + part_index, mask=part_mask[:, None], other=0.0)
    m_all = tl.max(m_parts, axis=0)  # [G]
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    weights = tl.exp(m_parts - m_safe[None, :])  # [S, G]; 0 for a range with nothing valid
    l_all = tl.sum(l_parts * weights, axis=0)
    l_safe = tl.where(l_all > 0, l_all, 1.0)
    if split == 0:  # the output: the ranges' partial outputs, rescaled to the global max, over the global sum
        out = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for part in range(0, splits):
            index = (kv * splits + part) * BLOCK_G + heads
            m_part = tl.load(m_ptr + index)
            acc = tl.load(acc_ptr + index[:, None] * HEAD_DIM + dims[None, :])
            out += acc * tl.exp(m_part - m_safe)[:, None]
        out = out / l_safe[:, None]
        tl.store(
            out_ptr + (kv * GROUP + heads[:, None]) * HEAD_DIM + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None],
        )
    # this range's probabilities, increments, scores and eviction candidate
    row = kv * slots
    logit_base = logit_ptr + kv * BLOCK_G * slots
    first = split * split_size
    end = tl.minimum(first + split_size, slots)
    best_score = tl.full([], float("inf"), tl.float32)
    best_token = tl.full([], INT64_MAX, tl.int64)
    best_slot = tl.full([], -1, tl.int64)
    for start in range(first, end, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        in_range = offs < end
        valid = tl.load(valid_ptr + row + offs, mask=in_range, other=0) != 0
        s = tl.load(logit_base + heads[:, None] * slots + offs[None, :], mask=in_range[None, :], other=0.0)
        p = tl.exp(s - m_safe[:, None]) / l_safe[:, None]
        p = tl.where(valid[None, :] & head_mask[:, None], p, 0.0)
        inc = tl.sum(p, axis=0)  # [N]
        score = tl.load(scores_ptr + row + offs, mask=in_range, other=0.0) + inc
        tl.store(scores_ptr + row + offs, score, mask=in_range)
        tl.store(inc_ptr + row + offs, inc, mask=in_range)
        rank = tl.load(rank_ptr + row + offs, mask=in_range, other=0)
        token = tl.load(tok_ptr + row + offs, mask=in_range, other=0)
        candidate = valid & (rank < recent_rank) & in_range
        priority = tl.where(candidate, score, float("inf"))
        low = tl.min(priority, axis=0)
        oldest = tl.min(tl.where(candidate & (priority == low), token, INT64_MAX), axis=0)
        slot = tl.min(
            tl.where(candidate & (priority == low) & (token == oldest), offs.to(tl.int64), slots), axis=0
        )
        better = (low < best_score) | ((low == best_score) & (oldest < best_token))
        better = better & (oldest != INT64_MAX)
        best_score = tl.where(better, low, best_score)
        best_token = tl.where(better, oldest, best_token)
        best_slot = tl.where(better, slot, best_slot)
    tl.store(best_score_ptr + kv * splits + split, best_score)
    tl.store(best_token_ptr + kv * splits + split, best_token)
    tl.store(best_slot_ptr + kv * splits + split, best_slot)
    # the last range of this KV head to finish picks among the ranges' candidates (acq_rel: their stores
    # above are visible to it)
    finished = tl.atomic_add(done_ptr + kv, 1)
    if finished == splits - 1:
        scores_in = tl.load(best_score_ptr + kv * splits + parts, mask=part_mask, other=float("inf"))
        tokens_in = tl.load(best_token_ptr + kv * splits + parts, mask=part_mask, other=INT64_MAX)
        slots_in = tl.load(best_slot_ptr + kv * splits + parts, mask=part_mask, other=-1)
        present = tokens_in != INT64_MAX
        low = tl.min(tl.where(present, scores_in, float("inf")), axis=0)
        oldest = tl.min(tl.where(present & (scores_in == low), tokens_in, INT64_MAX), axis=0)
        slot = tl.min(
            tl.where(present & (scores_in == low) & (tokens_in == oldest), slots_in, INT64_MAX), axis=0
        )
        tl.store(cand_ptr + kv, tl.where(oldest == INT64_MAX, -1, slot))


def decode_tiles(slots: int, n_kv_heads: int, group: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, split_size, splits): the one place the decode kernel's tiling is chosen.

    A key block of BLOCK_N slots makes a [group, BLOCK_N, head_dim] fp32 product in registers: about 8K
    values at most. The slots are cut into ranges of whole blocks so that n_kv_heads x splits programs come
    near `PROGRAMS` (at most `MAX_SPLITS` ranges per KV head, at least one block per range).
    """
    block_g = triton.next_power_of_2(group)
    block_n = max(16, min(64, triton.next_power_of_2(8192 // (block_g * head_dim) + 1) // 2))
    blocks = triton.cdiv(slots, block_n)
    splits = max(1, min(blocks, MAX_SPLITS, triton.cdiv(PROGRAMS, n_kv_heads)))
    split_size = triton.cdiv(blocks, splits) * block_n
    return block_n, split_size, triton.cdiv(slots, split_size)


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
    block_g = triton.next_power_of_2(group)
    block_n, split_size, splits = decode_tiles(slots, n_kv_heads, group, head_dim)
    device = query.device
    output = torch.empty_like(query)
    increments = torch.empty(n_kv_heads, slots, dtype=torch.float32, device=device)
    candidate = torch.empty(n_kv_heads, dtype=torch.int64, device=device)
    logits = torch.empty(n_kv_heads, block_g, slots, dtype=torch.float32, device=device)
    m_part = torch.empty(n_kv_heads, splits, block_g, dtype=torch.float32, device=device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(n_kv_heads, splits, block_g, head_dim, dtype=torch.float32, device=device)
    best_score = torch.empty(n_kv_heads, splits, dtype=torch.float32, device=device)
    best_token = torch.empty(n_kv_heads, splits, dtype=torch.int64, device=device)
    best_slot = torch.empty_like(best_token)
    done = torch.zeros(n_kv_heads, dtype=torch.int32, device=device)
    meta = {"GROUP": group, "BLOCK_G": block_g, "BLOCK_N": block_n, "HEAD_DIM": head_dim}
    valid_bytes = valid.view(torch.uint8)
    _partial_kernel[(n_kv_heads, splits)](
        query.contiguous(), keys, values, valid_bytes, key_positions, cos_table, sin_table,
        logits, m_part, l_part, acc_part,
        query_position, scaling, slots, split_size, splits, **meta,
    )  # fmt: skip
    _combine_kernel[(n_kv_heads, splits)](
        logits, m_part, l_part, acc_part, valid_bytes, rank, token_index,
        scores, output, increments, best_score, best_token, best_slot, done, candidate,
        recent_rank, slots, split_size, splits, BLOCK_S=triton.next_power_of_2(splits), **meta,
    )  # fmt: skip
    return output, increments, candidate
