"""Where a cache's buffers live and in which dtype: each decoder layer's device (a device map may split a
model), the compute dtype, and which kernels a device can run."""

from __future__ import annotations

import torch
from h2o_kernels.dispatch import kernels_choice, triton_possible

from h2o_cli.errors import UsageError


def compute_dtype(model) -> torch.dtype:
    """The dtype attention runs in: the first float parameter's (bitsandbytes weights are int8/uint8)."""
    for param in model.parameters():
        if param.dtype.is_floating_point:
            return param.dtype
    return model.dtype


def execution_device(module: torch.nn.Module) -> torch.device | None:
    """Where `module` runs: the execution device of an accelerate hook on it (`dispatch_model`, `cpu_offload`,
    `device_map=` with CPU or disk offload, whose weights then sit on `meta` or the CPU between calls), else
    its own weights' device; None for a module without weights (or only `meta` ones) and no hook."""
    hooks = [getattr(module, "_hf_hook", None)]
    while hooks:
        hook = hooks.pop()
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        hooks.extend(getattr(hook, "hooks", ()))  # accelerate's SequentialHook holds several
    for param in module.parameters(recurse=False):
        if param.device.type != "meta":
            return param.device
    return None


def layer_devices(model) -> list[torch.device]:
    """Each decoder layer's device, for its store, scores and archive: where its attention runs (its own hook
    or weights, else its decoder layer's, else the first weight's that is not on `meta`)."""
    fallback = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    devices = []
    for layer in model.model.layers:
        found = None
        for module in (layer.self_attn, *layer.self_attn.modules(), layer):
            found = execution_device(module)
            if found is not None:
                break
        devices.append(found or fallback)
    return devices


def check_kernels(kernels: str, device: torch.device) -> None:
    """Refuse `--kernels triton` (or `$H2O_KERNELS`) where Triton cannot run, and an unknown `$H2O_KERNELS`."""
    try:
        choice = kernels_choice(kernels)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if choice == "triton" and not triton_possible(device):
        raise UsageError(
            f"--kernels triton needs a CUDA device and the triton package (device: {device}); "
            "use --kernels torch or auto"
        )
    if choice == "native" and torch.device(device).type != "cpu":
        raise UsageError(
            f"--kernels native is the CPU's decode step (device: {device}); use --kernels torch or auto"
        )


__all__ = ["check_kernels", "compute_dtype", "execution_device", "layer_devices"]
