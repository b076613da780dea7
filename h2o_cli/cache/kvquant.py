"""int8 K/V storage: symmetric per-token quantisation (one scale per cached token and KV head).

A token's key (or value) vector `[head_dim]` is stored as int8 `round(x / s)` with `s = max|x| / 127`, so the
round-off of every element is at most `s / 2`. Scores and eviction never see these numbers: attention
dequantises them before the softmax, exactly as if the cache held `s * q`.
"""

from __future__ import annotations

import torch

KV_BITS = (16, 8)
INT8_MAX = 127.0
SCALE_DTYPE = torch.float32


def storage_dtype(kv_bits: int | None, model_dtype: torch.dtype) -> torch.dtype:
    """The K/V buffers' dtype: the model's (None), 16-bit (bf16 for a bf16 model, else fp16) or int8."""
    if kv_bits is None:
        return model_dtype
    if kv_bits == 16:
        return torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float16
    if kv_bits == 8:
        return torch.int8
    raise ValueError(f"kv_bits must be None, 16 or 8, not {kv_bits!r}")


def quantize(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """states [n_kv, chunk, head_dim] -> (int8 [n_kv, chunk, head_dim], scales [n_kv, chunk])."""
    scales = states.detach().abs().amax(dim=-1).float().clamp_min(1e-8) / INT8_MAX
    quantized = torch.round(states.float() / scales.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantized, scales.to(SCALE_DTYPE)


def dequantize(quantized: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [n_kv, slots, head_dim] and scales [n_kv, slots] -> `dtype` [n_kv, slots, head_dim]."""
    return quantized.to(dtype) * scales.unsqueeze(-1).to(dtype)
