"""Weight quantisation (`--quant`): which library does it on a device, and how."""

from __future__ import annotations

import torch

from h2o_cli.errors import UsageError
from h2o_cli.memory import QUANTS


def quant_backend(quant: str, device: torch.device) -> str:
    """Which library quantises the weights on `device`: "none", "bitsandbytes" or "torch-dynamic-int8".

    bitsandbytes >= 0.45 runs on the devices in `bitsandbytes.supported_torch_devices` (0.50.2: cpu, cuda,
    xpu, hpu, mps, npu; CPU via its own C library). Without bitsandbytes, 8-bit on CPU falls back to torch's
    own weight-only path (`torch.ao.quantization.quantize_dynamic`, int8 Linear); anything else is an error.
    """
    if quant not in QUANTS:
        raise UsageError(f"--quant {quant!r} is unknown; choose none, 8bit or 4bit")
    if quant == "none":
        return "none"
    try:
        import bitsandbytes
    except ImportError:
        if quant == "8bit" and device.type == "cpu":
            return "torch-dynamic-int8"
        raise UsageError(
            f"--quant {quant} on {device.type} needs bitsandbytes: pip install 'h2o-cli[quant]'"
        ) from None
    supported = set(getattr(bitsandbytes, "supported_torch_devices", {"cuda"}))
    if device.type not in supported:
        raise UsageError(
            f"--quant {quant}: bitsandbytes {bitsandbytes.__version__} does not run on {device.type} "
            f"(it supports {', '.join(sorted(supported))}); use --quant none or another --device"
        )
    return "bitsandbytes"


def quantization_config(quant: str, compute_dtype: torch.dtype):
    """BitsAndBytesConfig for `--quant 8bit` (LLM.int8) or `4bit` (nf4, computing in `compute_dtype`)."""
    from transformers import BitsAndBytesConfig

    if quant == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype
    )


def torch_int8(model):
    """Weight-only int8 for every decoder Linear with torch's own dynamic quantisation (CPU, no bitsandbytes)."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.model.layers = quantize_dynamic(model.model.layers, {torch.nn.Linear}, dtype=torch.qint8)
    return model
