"""GGUF files: dequantised once into a float safetensors folder that loads in about a second."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from h2o_cli.cache.families import family_refusal
from h2o_cli.errors import UnsupportedModelError

# A GGUF header's `general.architecture` where transformers loads it as another `model_type`.
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}


def gguf_family(gguf: Path) -> str:
    """The transformers `model_type` a GGUF file loads as, read from its header (`general.architecture`)
    alone: no tensor is read."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).get_field("general.architecture")
    architecture = field.contents() if field is not None else "?"
    return GGUF_MODEL_TYPES.get(architecture, architecture)


def check_gguf_family(gguf: Path) -> None:
    """Refuse, before any conversion, a GGUF file of a family the H2O cache cannot serve
    (`UnsupportedModelError`, one line naming the family and the supported ones)."""
    refusal = family_refusal(gguf_family(gguf))
    if refusal:
        raise UnsupportedModelError(f"{gguf.name}: {refusal}")


@contextmanager
def _no_tqdm():
    """transformers' GGUF reader draws a plain tqdm bar that its progress-bar switch does not reach (and
    tqdm reads TQDM_DISABLE only when imported): stderr carries our status and one-line errors only, so that
    module's bar is built disabled for the length of one conversion."""
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as reader

    bar = reader.tqdm
    reader.tqdm = partial(bar, disable=True)
    try:
        yield
    finally:
        reader.tqdm = bar


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF file once and save float safetensors + tokenizer in `target`.

    Safe when several processes convert at once: each writes a private folder and renames it into place;
    the first rename wins and the others keep that folder, so no reader ever sees a partial one.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _no_tqdm():
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
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
        if target.exists() and not (target / "config.json").is_file():
            shutil.rmtree(target, ignore_errors=True)  # a torn folder from an older, non-atomic conversion
        try:
            staging.rename(target)
        except OSError:
            # Another process (a second torchrun rank, a parallel test worker) finished first: keep its folder.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
