"""Helpers every command uses: loading a model quietly, the stderr console, byte sizes."""

from __future__ import annotations

import os
import sys

from rich import filesize
from rich.console import Console

stderr = Console(stderr=True, highlight=False)


def stdout_console() -> Console:
    """Console for tables on stdout: the terminal's width, or 160 columns when piped (rich would use 80)."""
    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=160)


def size(nbytes: float) -> str:
    """Bytes in binary units with one decimal ("13.4 MiB"), whole bytes below 1 KiB. rich picks the unit;
    its `filesize.decimal` formatter speaks only kB/MB, and every figure of h2o is in KiB/MiB/GiB."""
    unit, suffix = filesize.pick_unit_and_suffix(int(nbytes), ["B", "KiB", "MiB", "GiB", "TiB"], 1024)
    return f"{nbytes:,.0f} B" if unit == 1 else f"{nbytes / unit:,.1f} {suffix}"


def quiet_transformers() -> None:
    """No progress bars or advice from transformers on our stderr."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def set_threads(threads: int) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def load(
    model: str,
    device: str,
    dtype: str,
    trust_remote_code: bool,
    threads: int = 0,
    quant: str = "none",
    device_map: str | None = None,
):
    """(model, tokenizer), with a status line on a terminal while the weights load."""
    from h2o_cli.models import load_model

    quiet_transformers()
    set_threads(threads)
    args = dict(
        device=device, dtype=dtype, trust_remote_code=trust_remote_code, quant=quant, device_map=device_map
    )
    if sys.stderr.isatty():
        with stderr.status(f"loading {model} …"):
            return load_model(model, **args)
    return load_model(model, **args)
