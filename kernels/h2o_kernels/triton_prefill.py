"""Chunked prefill attention over the slot cache (Triton, flash-style). Reference: `h2o_kernels.prefill`.

Pass 1, one program per (query head, block of queries): online softmax over key blocks gives the output and
each query's log-sum-exp. Pass 2, one program per (KV head, block of slots): rotate the block's keys once,
then recompute the logits of every query block of the group against them, exponentiate against the stored
log-sum-exp and sum down the columns. Neither pass materialises the chunk x slots matrix. Rotation (rolling
or original positions) is applied on the fly from the cos/sin tables; `tiles` chooses the block sizes.
Softmax arithmetic is fp32. The matrix products take bf16/fp16 operands (fp32 accumulation) when the inputs
are bf16/fp16 on a GPU, as the torch reference's `bmm` does, and fp32 ("ieee") otherwise: under the
interpreter `tl.dot` on bf16 is wrong, so it always gets fp32 there.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from h2o_kernels.triton_decode import _rotated


@triton.jit
def _key_block(k_base, kv_row, offs, slots, valid_ptr, tok_ptr, kpos_ptr, cos_ptr, sin_ptr,
               HEAD_DIM: tl.constexpr):  # fmt: skip
    # A block of rotated keys [N, d] (fp32), which of them hold an entry, and their token indices.
    in_range = offs < slots
    valid = tl.load(valid_ptr + kv_row + offs, mask=in_range, other=0) != 0
    token = tl.load(tok_ptr + kv_row + offs, mask=in_range, other=0)
    pos = tl.maximum(tl.load(kpos_ptr + kv_row + offs, mask=in_range, other=0), 0)
    k = _rotated(k_base, offs, in_range, pos, cos_ptr, sin_ptr, HEAD_DIM)
    return k, valid, token


@triton.jit
def _product(a, b, DOT: tl.constexpr):
    # a @ b with fp32 accumulation: fp32 operands ("ieee") for DOT 0, bf16 for 1, fp16 for 2.
    if DOT == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif DOT == 2:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _logits(q, k, valid, token, query_index, scaling, DOT: tl.constexpr):
    # [M, N] scaled logits of rotated queries against rotated keys, -inf where the entry is not in E_q.
    s = _product(q, tl.trans(k), DOT) * scaling
    allowed = valid[None, :] & (token[None, :] <= query_index[:, None])
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, tok_ptr, kpos_ptr, cos_ptr, sin_ptr, out_ptr, lse_ptr,
    first_query_index, first_query_position, scaling, chunk, slots,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    kv = head // GROUP
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < chunk
    dims = tl.arange(0, HEAD_DIM)
    q = _rotated(q_ptr + head * chunk * HEAD_DIM, rows, row_mask, first_query_position + rows, cos_ptr, sin_ptr,
                 HEAD_DIM)  # fmt: skip
    query_index = first_query_index + rows
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = k_ptr + kv * slots * HEAD_DIM
    for start in range(0, slots, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        k, valid, token = _key_block(k_base, kv * slots, offs, slots, valid_ptr, tok_ptr, kpos_ptr, cos_ptr,
                                     sin_ptr, HEAD_DIM)  # fmt: skip
        s = _logits(q, k, valid, token, query_index, scaling, DOT)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(v_ptr + (kv * slots + offs[:, None]) * HEAD_DIM + dims[None, :], mask=(offs < slots)[:, None],
                    other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + _product(p, v, DOT)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    l_safe = tl.where(l_sum > 0, l_sum, 1.0)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + (head * chunk + rows[:, None]) * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None])  # fmt: skip
    tl.store(lse_ptr + head * chunk + rows, m + tl.log(l_safe), mask=row_mask)


@triton.jit
def _column_kernel(
    q_ptr, k_ptr, valid_ptr, tok_ptr, kpos_ptr, cos_ptr, sin_ptr, lse_ptr, inc_ptr, last_ptr,
    first_query_index, first_query_position, scaling, chunk, slots,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    kv = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # the block's keys, rotated once for every query block of every query head of the group
    k, valid, token = _key_block(k_ptr + kv * slots * HEAD_DIM, kv * slots, offs, slots, valid_ptr, tok_ptr,
                                 kpos_ptr, cos_ptr, sin_ptr, HEAD_DIM)  # fmt: skip
    column = tl.zeros([BLOCK_N], tl.float32)
    last = tl.zeros([BLOCK_N], tl.float32)
    for member in range(GROUP):
        head = kv * GROUP + member
        for start in range(0, chunk, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_mask = rows < chunk
            q = _rotated(q_ptr + head * chunk * HEAD_DIM, rows, row_mask, first_query_position + rows, cos_ptr,
                         sin_ptr, HEAD_DIM)  # fmt: skip
            s = _logits(q, k, valid, token, first_query_index + rows, scaling, DOT)
            lse = tl.load(lse_ptr + head * chunk + rows, mask=row_mask, other=0.0)
            p = tl.where(row_mask[:, None], tl.exp(s - lse[:, None]), 0.0)  # [M, N]
            column += tl.sum(p, axis=0)
            last += tl.sum(tl.where((rows == chunk - 1)[:, None], p, 0.0), axis=0)
    in_range = offs < slots
    tl.store(inc_ptr + kv * slots + offs, column, mask=in_range)
    tl.store(last_ptr + kv * slots + offs, last, mask=in_range)


def tiles(chunk: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): the one place tile sizes are chosen (tl.dot needs >= 16). The forward pass runs
    one program per (query head, BLOCK_M queries), the column pass one per (KV head, BLOCK_N slots)."""
    block_m = 16 if chunk <= 16 else (32 if chunk <= 32 else 64)
    block_n = 64 if head_dim <= 64 else 32
    return block_m, block_n


def dot_kind(dtype: torch.dtype) -> int:
    """The `DOT` operand type of the matrix products: 1 (bf16) or 2 (fp16) for those inputs on a real GPU,
    else 0 (fp32, "ieee"); the interpreter always gets 0 (its `tl.dot` on bf16 is wrong)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return 0
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)


def prefill_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    token_index: torch.Tensor,
    key_positions: torch.Tensor,
    first_query_index: int,
    first_query_position: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of `h2o_kernels.prefill.prefill_attention` (same arguments, same results)."""
    n_heads, chunk, head_dim = query.shape
    n_kv_heads, slots = valid.shape
    group = n_heads // n_kv_heads
    query = query.contiguous()
    output = torch.empty_like(query)
    lse = torch.empty(n_heads, chunk, dtype=torch.float32, device=query.device)
    increments = torch.empty(n_kv_heads, slots, dtype=torch.float32, device=query.device)
    last_probs = torch.empty_like(increments)
    block_m, block_n = tiles(chunk, head_dim)
    valid_bytes = valid.view(torch.uint8)
    common = (first_query_index, first_query_position, scaling, chunk, slots)
    meta = {"GROUP": group, "BLOCK_M": block_m, "BLOCK_N": block_n, "HEAD_DIM": head_dim,
            "DOT": dot_kind(query.dtype)}  # fmt: skip
    _forward_kernel[(n_heads, triton.cdiv(chunk, block_m))](
        query, keys, values, valid_bytes, token_index, key_positions, cos_table, sin_table, output, lse,
        *common, **meta,
    )  # fmt: skip
    _column_kernel[(n_kv_heads, triton.cdiv(slots, block_n))](
        query, keys, valid_bytes, token_index, key_positions, cos_table, sin_table, lse, increments, last_probs,
        *common, **meta,
    )  # fmt: skip
    return output, increments, last_probs
