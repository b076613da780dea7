"""Which implementation runs: the Triton kernels or the pure-torch references (same signatures, same results).

`kernels` (the cache setting `--kernels`, else `$H2O_KERNELS`) is `auto`, `torch`, `triton` or `native`.
`auto` is the torch path on a GPU for now: on an H200 (docs/benchmarks.md, "Are the Triton kernels faster on a
GPU?") the fused decode kernel beat the torch reference at 1,024 slots but lost from 4,096 on, and the two-pass
prefill kernel was hundreds of times slower than SDPA (each launches one program per KV head), so the kernels
are opt-in (`--kernels triton`). On the CPU, `auto` (or `native`) runs a full cache's decode step as one C
function (`native.py`) when a C compiler can build it, else the torch path. None of these choices applies to a
decode step captured by `--compile` (h2o_cli.compiled): it always runs the cache's fixed step, in torch ops,
compiled. The Triton path must not be what a run depends on: a kernel that fails to compile or launch is
reported once (one warning line, logger `h2o_kernels`) and the torch path runs instead, for that call and the
rest of the process.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from h2o_kernels import decode, native, prefill

KERNELS = ("auto", "torch", "triton", "native")
ENV = "H2O_KERNELS"
logger = logging.getLogger("h2o_kernels")
_failure: str | None = None  # why the Triton path was given up in this process, once it was


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_choice(kernels: str = "auto") -> str:
    """`kernels` with `auto` replaced by `$H2O_KERNELS` when set (`reference` is an old name for `torch`)."""
    if kernels == "auto":
        kernels = os.environ.get(ENV, "auto").strip().lower() or "auto"
        kernels = "torch" if kernels == "reference" else kernels
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r} (from ${ENV}?)")
    return kernels


def triton_possible(device: torch.device) -> bool:
    """Whether the Triton kernels can be tried on `device`: CUDA, with triton installed."""
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    return device_type == "cuda" and triton_importable()


def use_triton(device: torch.device, kernels: str = "auto") -> bool:
    """True when the Triton kernels run on `device` for the setting `kernels` (see the module docstring);
    False for good once a Triton kernel has failed in this process."""
    if _failure is not None or not triton_possible(device):  # the CPU's answer, first and cheap
        return False
    return kernels_choice(kernels) == "triton"


def use_native(device: torch.device, kernels: str = "auto") -> bool:
    """True when a CPU decode step runs as the C function (`h2o_kernels.native`): on the CPU under `auto` or
    `native`, once it has been built (else the torch path; `native` says why in one warning line)."""
    if device.type != "cpu":
        return False
    choice = kernels_choice(kernels)
    return choice in ("auto", "native") and native.available(explicit=choice == "native")


def fall_back(error: BaseException) -> None:
    """Give up the Triton path for this process; the first failure is logged as one warning line."""
    global _failure
    if _failure is None:
        _failure = f"{type(error).__name__}: {error}".splitlines()[0]
        logger.warning("Triton kernel failed (%s); using the torch path from now on", _failure)


def _triton_decode(*args):
    from h2o_kernels import triton_decode  # triton is optional: imported on the first CUDA call

    return triton_decode.decode_attention(*args)


def _triton_prefill(*args):
    from h2o_kernels import triton_prefill

    return triton_prefill.prefill_attention(*args)


def decode_attention(*args, kernels: str = "auto"):
    """`h2o_kernels.decode.decode_attention` (same arguments), on the Triton kernel when `use_triton` says
    so. A Triton failure is raised before any state changes (compile or launch), so the torch path redoes
    the whole call."""
    if use_triton(args[0].device, kernels):
        try:
            return _triton_decode(*args)
        except Exception as error:  # compile error, missing driver/ptxas, out of resources, launch error
            fall_back(error)
    return decode.decode_attention(*args)


def prefill_attention(*args, kernels: str = "auto"):
    """`h2o_kernels.prefill.prefill_attention` (same arguments), like `decode_attention`."""
    if use_triton(args[0].device, kernels):
        try:
            return _triton_prefill(*args)
        except Exception as error:
            fall_back(error)
    return prefill.prefill_attention(*args)
