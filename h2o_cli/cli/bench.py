"""`h2o bench`: speed and memory figures on this machine, written into docs/benchmarks.md if asked."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from h2o_cli.cli import options as opt
from h2o_cli.cli.common import load, stderr
from h2o_cli.errors import InputError, UsageError

EXAMPLES = """
Examples:

  h2o bench --quick --threads 1 --data-dir ~/h2o-data
  h2o bench --threads 2 --out docs/benchmarks.md
  h2o bench --only speed,stream --rounds 2 --threads 1 --out docs/benchmarks.md
  h2o bench --only speed --device cuda --kernels torch
"""


def parse_contexts(value: str) -> tuple[int, ...]:
    try:
        contexts = tuple(sorted(int(part) for part in value.split(",") if part.strip()))
    except ValueError:
        raise UsageError(f"--contexts {value!r}: give token counts like 1024,4096,8000") from None
    if not contexts or contexts[0] < 2:
        raise UsageError(f"--contexts {value!r}: give token counts like 1024,4096,8000")
    return contexts


def parse_parts(value: str | None) -> tuple[str, ...]:
    from h2o_cli.bench import PARTS

    if value is None:
        return PARTS
    parts = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        raise UsageError(f"--only {value!r}: choose parts from {', '.join(PARTS)}")
    return parts


def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes: a few minutes.")] = False,
    flat_to: Annotated[
        int | None, typer.Option("--flat-to", min=2, help="Token of the flat-cost end point.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Markdown file whose bench section is rewritten.")
    ] = None,
    gguf: Annotated[Path | None, typer.Option("--gguf", help="GGUF file to time under llama.cpp.")] = None,
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            help="Comma-separated parts: speed (plain transformers vs h2o decode), stream, policies, flat, "
            "prefill, llama_cpp. Default: all.",
        ),
    ] = None,
    contexts: Annotated[
        str | None,
        typer.Option(
            "--contexts", help="Comma-separated contexts of the decode parts (default 1024,4096,8000)."
        ),
    ] = None,
    rounds: Annotated[
        int, typer.Option("--rounds", min=1, help="Alternating plain/h2o rounds of the speed part.")
    ] = 2,
    device: opt.Device = "cpu",
    device_map: opt.DeviceMap = None,
    kernels: opt.Kernels = "auto",
    data_dir: opt.DataDir = None,
    model: opt.Model = opt.DEFAULTS["model"],
    as_json: opt.Json = False,
    threads: opt.Threads = 1,
) -> None:
    """h2o vs plain transformers (decode at 1K/4K/8K with the byte-model ceiling, stream speed), decode vs
    our full cache, policy overhead, flat streaming cost, prefill memory (and llama.cpp)."""
    from h2o_cli import bench as lib
    from h2o_cli.eval.data import data_dir as data_folder

    book = data_folder(data_dir) / lib.BOOK
    if not book.is_file():
        raise InputError(f"{book} not found: h2o bench reads War and Peace from the data folder")

    parts = parse_parts(only)
    plan = lib.BenchPlan.quick() if quick else lib.BenchPlan()
    plan = dataclasses.replace(plan, parts=parts, rounds=rounds, kernels=kernels)
    if contexts is not None:
        plan = dataclasses.replace(plan, contexts=parse_contexts(contexts))
    if flat_to is not None:
        plan = dataclasses.replace(plan, flat_points=(min(plan.flat_points[0], flat_to // 2), flat_to))
    lm, tokenizer = load(model, device, "auto", False, threads, device_map=device_map)
    import torch

    stderr.print(f"torch threads: {torch.get_num_threads()}; another process may share the CPU")
    report = lib.run(lm, tokenizer, model, plan, book, gguf, progress=lambda text: stderr.print(f"· {text}"))
    command = " ".join(
        ["h2o bench"]
        + (["--quick"] if quick else [])
        + ([f"--only {','.join(parts)}"] if only else [])
        + ([f"--contexts {contexts}"] if contexts else [])
        + ([f"--rounds {rounds}"] if rounds != 2 else [])
        + ([f"--device {device}"] if device != "cpu" else [])
        + ([f"--kernels {kernels}"] if kernels != "auto" else [])
        + [f"--threads {threads}"]
    )
    section = lib.markdown(report, command)
    if out is not None:
        lib.write_section(out, section)
        stderr.print(f"wrote {out}")
    if as_json:
        speed = {"speed": report.speed, "stream": report.stream, "bandwidth": report.bandwidth}
        print(json.dumps({"threads": report.threads, "rows": report.rows, "notes": report.notes, **speed}))
    else:
        stderr.print(section)


bench.__doc__ += EXAMPLES
