"""Loading a model and its tokenizer, ready for `H2OCache`."""

from __future__ import annotations

from h2o_cli.cache.families import SUPPORTED_FAMILIES
from h2o_cli.errors import UnsupportedModelError, UsageError
from h2o_cli.models.device import pick_device, pick_dtype, pick_read_dtype
from h2o_cli.models.precision import read_in_bf16
from h2o_cli.models.presets import DEFAULT_MODEL
from h2o_cli.models.quant import quant_backend, quantization_config, torch_int8
from h2o_cli.models.sources import load_config, local_folder, not_found, offline, resolve
from h2o_cli.private import h2o_home, private_folder

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def load_model(
    name: str = DEFAULT_MODEL,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    quant: str = "none",
    device_map: str | None = None,
):
    """Load (model, tokenizer) for an alias, .gguf file, folder or hub id, ready for `H2OCache`.

    `quant`: none, 8bit or 4bit weights (`quant_backend` says which library; the model's `h2o_quant`
    attribute records it). A GGUF is first converted to a float safetensors folder, then quantised.
    `device_map`: auto, balanced or a JSON file of module name -> device ("cuda:0", "cpu", "disk"), placed
    by accelerate (`device_map_for`); `device` then only picks the dtype. The cache follows each layer.
    `dtype` auto on a CPU with native bf16 matmuls: fp32 weights, read calls multiplied in bf16 against a bf16
    copy (`precision.read_in_bf16`; not with --quant or --device-map); `model.h2o_read_dtype` records it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from h2o_cli.cache.attention import enable

    source = resolve(name)
    config = load_config(source, trust_remote_code)
    family = getattr(config, "model_type", "?")
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"{name} is a {family!r} model; the H2O cache supports {', '.join(SUPPORTED_FAMILIES)} "
            "(rotary positions) — pick one of those (see `h2o models`)"
        )
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    backend = quant_backend(quant, torch_device)
    folder = local_folder(source)
    extra = {"local_files_only": True} if offline(source) else {}
    if backend == "bitsandbytes":
        extra["quantization_config"] = quantization_config(quant, torch_dtype)
        extra["device_map"] = str(torch_device)
    elif torch_device.type == "cuda":
        extra["device_map"] = str(torch_device)
    if device_map:
        extra["device_map"] = device_map_for(device_map)
        extra["offload_folder"] = str(offload_folder(name))
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            folder, trust_remote_code=trust_remote_code, local_files_only=offline(source)
        )
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, trust_remote_code=trust_remote_code, **extra
        )
    except (OSError, ValueError) as error:
        raise not_found(source, error) from error
    if backend != "bitsandbytes" and not device_map:  # bitsandbytes and accelerate place the weights
        model.to(torch_device)
    if backend == "torch-dynamic-int8":
        model = torch_int8(model)
    model.eval()
    if pick_read_dtype(dtype, torch_device) is not None and backend == "none" and not device_map:
        read_in_bf16(model)
    model.h2o_name = name
    model.h2o_quant = quant
    model.h2o_quant_backend = backend
    enable(model)
    return model, tokenizer


def device_map_for(value: str) -> str | dict[str, str | int]:
    """`--device-map`: one of accelerate's strategies (auto, balanced, ...), or a JSON file naming each
    module's device, e.g. {"model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0", "model.layers.1":
    "cpu", "model.layers.2": "disk", ...} (every module of the model, or its ancestors, must be named)."""
    import json
    from pathlib import Path

    if value in DEVICE_MAPS:
        return value
    path = Path(value)
    if not path.is_file():
        raise UsageError(
            f"--device-map {value}: not {', '.join(DEVICE_MAPS)} and no such file (a JSON object of module -> device)"
        )
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UsageError(f"--device-map {value}: not a JSON object of module -> device ({error})") from None
    if not isinstance(mapping, dict) or not all(
        isinstance(device, (str, int)) for device in mapping.values()
    ):
        raise UsageError(f"--device-map {value}: not a JSON object of module -> device")
    return mapping


def offload_folder(name: str):
    """Where accelerate writes the weights a device map sends to "disk" (one folder per model name)."""
    import hashlib

    return private_folder(h2o_home() / "offload" / hashlib.sha1(name.encode()).hexdigest()[:12])


def planned_layer_devices(config, device_map: str, dtype) -> list[str]:
    """The device each decoder layer's attention will run on under `--device-map`, from the config alone (an
    empty-weight model for auto/balanced, as accelerate plans them): where `H2OCache` will put each layer's
    cache. A layer sent to "cpu" or "disk" with a GPU in the map runs on the map's first GPU (accelerate's
    offload brings its weights there); without one, on the CPU."""
    from accelerate import init_empty_weights
    from accelerate.utils import get_balanced_memory, infer_auto_device_map
    from transformers import AutoModelForCausalLM

    mapping = device_map_for(device_map)
    n_layers = int(getattr(config.get_text_config(), "num_hidden_layers", 0))
    if isinstance(mapping, str):
        with init_empty_weights():
            empty = AutoModelForCausalLM.from_config(config, dtype=dtype)
        empty.tie_weights()
        no_split = getattr(empty, "_no_split_modules", None) or []
        memory = None
        if mapping.startswith("balanced"):
            memory = get_balanced_memory(
                empty, dtype=dtype, no_split_module_classes=no_split, low_zero=mapping == "balanced_low_0"
            )
        mapping = infer_auto_device_map(
            empty, max_memory=memory, no_split_module_classes=no_split, dtype=dtype
        )
    devices = [f"cuda:{device}" if isinstance(device, int) else str(device) for device in mapping.values()]
    main = next((device for device in devices if device not in ("cpu", "disk")), "cpu")  # accelerate's
    placed = []
    for number in range(n_layers):
        name = f"model.layers.{number}.self_attn"
        owners = [key for key in mapping if key == "" or name == key or name.startswith(key + ".")]
        if not owners:
            raise UsageError(f"--device-map {device_map} names no device for {name} (nor a module above it)")
        device = mapping[max(owners, key=len)]
        device = f"cuda:{device}" if isinstance(device, int) else str(device)
        placed.append(main if device in ("cpu", "disk") else device)
    return placed
