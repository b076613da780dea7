"""Loading a model and its tokenizer, ready for `H2OCache`."""

from __future__ import annotations

from h2o_cli.cache.families import SUPPORTED_FAMILIES
from h2o_cli.errors import UnsupportedModelError
from h2o_cli.models.device import pick_device, pick_dtype
from h2o_cli.models.presets import DEFAULT_MODEL
from h2o_cli.models.quant import quant_backend, quantization_config, torch_int8
from h2o_cli.models.sources import load_config, local_folder, not_found, offline, resolve


def load_model(
    name: str = DEFAULT_MODEL,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    quant: str = "none",
):
    """Load (model, tokenizer) for an alias, .gguf file, folder or hub id, ready for `H2OCache`.

    `quant`: none, 8bit or 4bit weights (`quant_backend` says which library; the model's `h2o_quant`
    attribute records it). A GGUF is first converted to a float safetensors folder, then quantised.
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
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            folder, trust_remote_code=trust_remote_code, local_files_only=offline(source)
        )
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, trust_remote_code=trust_remote_code, **extra
        )
    except (OSError, ValueError) as error:
        raise not_found(source, error) from error
    if backend != "bitsandbytes":  # bitsandbytes places the weights itself; they cannot be moved
        model.to(torch_device)
    if backend == "torch-dynamic-int8":
        model = torch_int8(model)
    model.eval()
    model.h2o_name = name
    model.h2o_quant = quant
    model.h2o_quant_backend = backend
    enable(model)
    return model, tokenizer
