"""`h2o bench`: speed and memory figures on this machine, written into docs/benchmarks.md if asked."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from h2o_cli.cli import options as opt
from h2o_cli.cli.common import load, stderr
from h2o_cli.errors import InputError

EXAMPLES = """
Examples:

  h2o bench --quick --threads 1 --data-dir ../shared/data
  h2o bench --threads 2 --out docs/benchmarks.md
"""


def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes: a few minutes.")] = False,
    flat_to: Annotated[
        int | None, typer.Option("--flat-to", min=2, help="Token of the flat-cost end point.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Markdown file whose bench section is rewritten.")
    ] = None,
    gguf: Annotated[Path | None, typer.Option("--gguf", help="GGUF file to time under llama.cpp.")] = None,
    data_dir: opt.DataDir = None,
    model: opt.Model = opt.DEFAULTS["model"],
    as_json: opt.Json = False,
    threads: opt.Threads = 1,
) -> None:
    """Decode speed vs full cache, policy overhead, flat streaming cost, prefill memory (and llama.cpp)."""
    from h2o_cli import bench as lib
    from h2o_cli.eval.data import data_dir as data_folder

    book = data_folder(data_dir) / lib.BOOK
    if not book.is_file():
        raise InputError(f"{book} not found: h2o bench reads War and Peace from the data folder")

    plan = lib.BenchPlan.quick() if quick else lib.BenchPlan()
    if flat_to is not None:
        plan = dataclasses.replace(plan, flat_points=(min(plan.flat_points[0], flat_to // 2), flat_to))
    lm, tokenizer = load(model, "cpu", "auto", False, threads)
    stderr.print(f"threads: {threads or 'torch default'}; another process may share the CPU")
    report = lib.run(lm, tokenizer, model, plan, book, gguf, progress=lambda text: stderr.print(f"· {text}"))
    command = "h2o bench" + (" --quick" if quick else "") + f" --threads {threads}"
    section = lib.markdown(report, command)
    if out is not None:
        lib.write_section(out, section)
        stderr.print(f"wrote {out}")
    if as_json:
        print(json.dumps({"threads": report.threads, "rows": report.rows, "notes": report.notes}))
    else:
        stderr.print(section)


bench.__doc__ += EXAMPLES
