"""Which device and dtype a model runs on (`--device`, `--dtype`)."""

from __future__ import annotations

import torch

from h2o_cli.errors import UsageError


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA device is available here; use --device cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype the weights load in (the model's dtype; `pick_read_dtype` says how a read multiplies)."""
    if dtype == "auto":
        # bf16 decodes slower than fp32 on CPUs without native bf16 matmuls (measured: ENV-NOTES.md).
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise UsageError(f"--dtype {dtype!r} is unknown; choose auto, float32, bfloat16 or float16") from None


def pick_read_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """bf16 where `--dtype auto` on a CPU with native bf16 matmuls (`precision.cpu_has_bf16`): read calls
    then multiply in bf16 against a copy of the fp32 weights (`precision.read_in_bf16`). None otherwise:
    every matmul in the model's dtype, as `--dtype float32` always does."""
    from h2o_cli.models.precision import cpu_has_bf16

    if dtype == "auto" and device.type == "cpu" and cpu_has_bf16():
        return torch.bfloat16
    return None
