"""Which implementation runs: the Triton kernels on CUDA when triton imports, the pure-torch references otherwise."""

from __future__ import annotations

import functools
import os

import torch

from h2o_kernels import decode, prefill


@functools.cache
def triton_available() -> bool:
    if os.environ.get("H2O_KERNELS", "auto") == "reference":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(device: torch.device) -> bool:
    """True on a CUDA device with triton installed (H2O_KERNELS=reference forces the torch path)."""
    return device.type == "cuda" and triton_available()


def decode_attention(*args, **kwargs):
    """`h2o_kernels.decode.decode_attention`, on the Triton kernel when `use_triton` says so."""
    if use_triton(args[0].device):
        from h2o_kernels import triton_decode

        return triton_decode.decode_attention(*args, **kwargs)
    return decode.decode_attention(*args, **kwargs)


def prefill_attention(*args, **kwargs):
    """`h2o_kernels.prefill.prefill_attention`, on the Triton kernel when `use_triton` says so."""
    if use_triton(args[0].device):
        from h2o_kernels import triton_prefill

        return triton_prefill.prefill_attention(*args, **kwargs)
    return prefill.prefill_attention(*args, **kwargs)
