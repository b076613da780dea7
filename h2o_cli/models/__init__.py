"""Models: presets, where a `--model` points, device/dtype, GGUF conversion, quantisation, loading.

presets.py   aliases and public configs      sources.py  resolution, configs, the hub
device.py    --device / --dtype              gguf.py     GGUF -> safetensors
quant.py     --quant backends                loading.py  load_model
precision.py bf16 reads beside fp32 decode (--dtype auto on a CPU with native bf16)
The supported families are the cache's to say (`h2o_cli.cache.families`); they are re-exported here.
"""

from h2o_cli.cache.families import SUPPORTED_FAMILIES, check_family, context_window, text_config
from h2o_cli.memory import QUANTS
from h2o_cli.models import calibration  # noqa: F401  (registers `--recall-lead auto`'s calibration with the cache)
from h2o_cli.models.device import pick_device, pick_dtype, pick_read_dtype
from h2o_cli.models.gguf import convert_gguf
from h2o_cli.models.loading import load_model
from h2o_cli.models.presets import DEFAULT_MODEL, PRESETS, PUBLIC_CONFIGS, ModelPreset
from h2o_cli.models.quant import quant_backend, quantization_config, torch_int8
from h2o_cli.models.sources import (
    ModelSource,
    config_for,
    describe_presets,
    embedded_gguf,
    gguf_cache_dir,
    h2o_home,
    hub_cached,
    hub_reachable,
    load_config,
    local_folder,
    not_found,
    resolve,
)

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "PUBLIC_CONFIGS",
    "QUANTS",
    "SUPPORTED_FAMILIES",
    "ModelPreset",
    "ModelSource",
    "check_family",
    "config_for",
    "context_window",
    "convert_gguf",
    "describe_presets",
    "embedded_gguf",
    "gguf_cache_dir",
    "h2o_home",
    "hub_cached",
    "hub_reachable",
    "load_config",
    "load_model",
    "local_folder",
    "not_found",
    "pick_device",
    "pick_dtype",
    "pick_read_dtype",
    "quant_backend",
    "quantization_config",
    "resolve",
    "text_config",
    "torch_int8",
]
