"""A bf16 read's attention with its rotations and its softmax as C calls (`read.c`), in the library `native`
builds.

`reference.slot_attention` with bf16 matmuls and the keys in token order spends more time between its two
matmuls than in them: the masks added, the softmax widened to float32, the probabilities copied back to bf16 for
PV, their sums over the queries — five passes over a [chunk, slots] block per query head, each through memory;
and some fifteen small ops rotate, scale and round q and k before the first matmul, each paying torch's dispatch
and its thread pool's fork/join. `read.c` rotates straight into bf16 (torch's operations in torch's order: the
same bits) and does the softmax's passes in one pass per row, on one thread: split between two (Python threads
calling it with the GIL released) it was no faster inside a read on this project's 2-core CPU, where torch's own
threads wake or spin around it (docs/benchmarks.md).

The results are the reference's up to float rounding: bf16 probabilities equal to the last bit but for rare
ties in rounding, float32 sums within a few ulp (tests/test_native_read.py).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from h2o_kernels import native
from h2o_kernels.reference import slot_attention as reference_attention

_INT, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def _functions():
    library = native.library()
    library.read_softmax.argtypes = [_INT] * 5 + [_PTR] * 7
    library.read_softmax.restype = None
    library.rotate_to_bf16.argtypes = [_INT] * 3 + [_PTR] * 3 + [ctypes.c_float, _PTR]
    library.rotate_to_bf16.restype = None
    return library.read_softmax, library.rotate_to_bf16


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def read_softmax(
    logits: torch.Tensor, leading: torch.Tensor | None = None, query_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The masked softmax of `logits` [n_kv_heads, group, chunk, slots] (bf16, contiguous; the keys in token
    order, the chunk's own last), as `reference.slot_attention` with `allowed` None takes it: `leading`
    [n_kv_heads, m] bool hides the first m keys' empty slots, `query_weights` [chunk] float32 weighs the score
    sums (None: 1). Returns the probabilities [n_kv_heads, group * chunk, slots] in bf16 (for PV), the score
    increments and the last query's probabilities [n_kv_heads, slots] in float32."""
    n_kv, group, chunk, slots = logits.shape
    assert logits.dtype == torch.bfloat16 and logits.is_contiguous() and logits.device.type == "cpu"
    probs = torch.empty(n_kv, group * chunk, slots, dtype=torch.bfloat16)
    sums = torch.zeros(2, n_kv, slots)  # the score increments and the last query's probabilities
    present = None if leading is None else leading.to(torch.uint8).contiguous()
    weights = None if query_weights is None else query_weights.float().contiguous()
    scratch = torch.empty(slots)  # one row's float32 logits; held here for the call
    _functions()[0](
        n_kv, group, chunk, slots, 0 if leading is None else leading.shape[1],
        logits.data_ptr(), _address(present), _address(weights), probs.data_ptr(),
        sums[0].data_ptr(), sums[1].data_ptr(), scratch.data_ptr(),
    )  # fmt: skip
    return probs, sums[0], sums[1]


def rotate_to_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`reference.rotate(x, cos, sin) * scale` rounded to bf16, bit for bit, in one C call: x [n, rows,
    head_dim] float32; cos, sin [rows, head_dim] (shared by the n) or [n, rows, head_dim] float32 (an
    expanded table is read once). Returns [n, rows, head_dim] bf16."""
    assert x.dtype == cos.dtype == sin.dtype == torch.float32 and x.device.type == "cpu"
    if cos.dim() == 3 and cos.stride(0) == 0 and sin.stride(0) == 0:  # one table expanded over the n
        cos, sin = cos[0], sin[0]
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    head_dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _functions()[1](
        x.numel() // head_dim, head_dim, cos.numel() // head_dim, x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        scale, out.data_ptr(),
    )  # fmt: skip
    return out


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
    """`reference.slot_attention` of a float32 read in token order with bf16 matmuls (`allowed` None,
    `matmul_dtype` bfloat16, on the CPU; any other call goes to the reference), q and k by `rotate_to_bf16`,
    the softmax by `read_softmax`. Same arguments and results."""
    if (
        allowed is not None
        or matmul_dtype is not torch.bfloat16
        or query.device.type != "cpu"
        or not query.dtype == keys.dtype == query_cos.dtype == key_cos.dtype == torch.float32
    ):
        return reference_attention(
            query, keys, values, allowed, query_cos, query_sin, key_cos, key_sin, scaling,
            query_weights, matmul_dtype, leading,
        )  # fmt: skip
    n_heads, chunk, head_dim = query.shape
    n_kv, slots = keys.shape[:2]
    q = rotate_to_bf16(query, query_cos, query_sin, scaling).view(n_kv, -1, head_dim)
    k = rotate_to_bf16(keys, key_cos, key_sin)
    logits = torch.bmm(q, k.transpose(1, 2)).view(n_kv, n_heads // n_kv, chunk, slots)
    probs, increments, last = read_softmax(logits, leading, query_weights)
    output = torch.bmm(probs, values.to(matmul_dtype)).to(values.dtype)
    return output.view(n_heads, chunk, head_dim), increments, last
