"""Precision per phase (`--dtype auto` on a CPU with native bf16 matmuls): reading in bf16, the rest in fp32.

A read call (a chunk of the text, at least `READ_ROWS` rows through a linear layer) multiplies in bf16 against
a bf16 copy of the weights, taking fp32 in and giving fp32 out; a decode-size call (fewer rows) multiplies the
fp32 weights as before, where bf16 is no faster on such a CPU (measured: docs/benchmarks.md). The cache's
attention, its scores, the positions and the C decode step never see bf16: only `nn.Linear` layers change
(the model's projections, MLPs and `lm_head`, a tied one included). The copy costs half the fp32 weights' bytes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

READ_ROWS = 16  # a call of at least this many rows (tokens) multiplies in bf16
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo flags of native bf16 dot products
CPUINFO = Path("/proc/cpuinfo")


def cpu_has_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX-BF16 in `cpuinfo`'s flags) and torch's
    oneDNN can use it. False where the file is missing (not Linux) or names neither flag."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return bool(flags & BF16_FLAGS) and torch.backends.mkldnn.is_available()


class PhaseLinear(nn.Linear):
    """An `nn.Linear` that multiplies a call of at least `READ_ROWS` rows in bf16 (`read_weight`, a
    non-persistent bf16 copy of `weight`) and a smaller one with the fp32 `weight`, exactly as `nn.Linear`.
    x: [..., in_features] fp32 -> [..., out_features] fp32 either way."""

    read_weight: torch.Tensor
    read_bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= READ_ROWS * x.shape[-1]:
            return F.linear(x.to(torch.bfloat16), self.read_weight, self.read_bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def read_in_bf16(model: nn.Module) -> nn.Module:
    """Turn every plain fp32 `nn.Linear` of `model` into a `PhaseLinear` in place (its bf16 copy made now,
    on the weight's device) and record it on `model.h2o_read_dtype`. Returns `model`. A tied `lm_head` gets
    its own copy; the embedding lookup keeps the fp32 table."""
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.float32:
            module.__class__ = PhaseLinear
            module.register_buffer("read_weight", module.weight.detach().to(torch.bfloat16), persistent=False)
            bias = None if module.bias is None else module.bias.detach().to(torch.bfloat16)
            module.register_buffer("read_bias", bias, persistent=False)
    model.h2o_read_dtype = (
        torch.bfloat16
    )  # the cache's chunk path multiplies QK^T and PV of such a read in it
    model.h2o_read_rows = READ_ROWS
    return model


def read_copy_bytes(model: nn.Module) -> int:
    """Bytes of the bf16 copies `read_in_bf16` added (0 for a model without them)."""
    return sum(
        buffer.numel() * buffer.element_size()
        for module in model.modules()
        if isinstance(module, PhaseLinear)
        for buffer in (module.read_weight, module.read_bias)
        if buffer is not None
    )


def matmul_precision(model: nn.Module) -> dict:
    """What `--json` reports: the dtype of the linear layers' matmuls in a read call (>= `READ_ROWS` rows)
    and in a decode call, and the bytes of the bf16 copy (0 without one)."""
    weights = str(next(model.parameters()).dtype).removeprefix("torch.")
    read = getattr(model, "h2o_read_dtype", None)
    return {
        "read_matmul": str(read).removeprefix("torch.") if read is not None else weights,
        "decode_matmul": weights,
        "read_copy_bytes": read_copy_bytes(model),
    }
