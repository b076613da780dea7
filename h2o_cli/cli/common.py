"""Helpers every command uses: loading a model quietly, the stderr console."""

from __future__ import annotations

import os
import sys

from rich.console import Console

stderr = Console(stderr=True, highlight=False)


def stdout_console() -> Console:
    """Console for tables on stdout: the terminal's width, or 160 columns when piped (rich would use 80)."""
    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=160)


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


def load(model: str, device: str, dtype: str, trust_remote_code: bool, threads: int = 0, quant: str = "none"):
    """(model, tokenizer), with a status line on a terminal while the weights load."""
    from h2o_cli.models import load_model

    quiet_transformers()
    set_threads(threads)
    if sys.stderr.isatty():
        with stderr.status(f"loading {model} …"):
            return load_model(
                model, device=device, dtype=dtype, trust_remote_code=trust_remote_code, quant=quant
            )
    return load_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code, quant=quant)
