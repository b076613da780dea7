"""`h2o bench`: speed and memory figures on this machine, written into docs/benchmarks.md if asked."""

from __future__ import annotations

import dataclasses
import json
import shlex
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
  h2o bench --only recall --contexts 32768 --budget 819 --run h2o --run recall --rounds 1 --threads 1
  h2o bench --only paired --old ../h2o-before --contexts 1024,4096,8000 --rounds 30 --block 16
  h2o bench --only streams --contexts 10000 --chunks 256,1 --max-chunk1-tokens 2000
"""

RECALL_PANEL = "Settings against each other (--only recall)"
PAIRED_PANEL = "Two checkouts (--only paired)"
STREAMS_PANEL = "h2o stream per policy (--only streams)"


def parse_contexts(value: str) -> tuple[int, ...]:
    try:
        contexts = tuple(sorted(int(part) for part in value.split(",") if part.strip()))
    except ValueError:
        raise UsageError(f"--contexts {value!r}: give token counts like 1024,4096,8000") from None
    if not contexts or contexts[0] < 2:
        raise UsageError(f"--contexts {value!r}: give token counts like 1024,4096,8000")
    return contexts


def parse_parts(value: str | None) -> tuple[str, ...]:
    from h2o_cli.bench import ON_REQUEST, PARTS

    if value is None:
        return PARTS
    parts = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [part for part in parts if part not in PARTS + ON_REQUEST]
    if unknown or not parts:
        raise UsageError(f"--only {value!r}: choose parts from {', '.join(PARTS + ON_REQUEST)}")
    return parts


def parse_chunks(value: str) -> tuple[int, ...]:
    try:
        chunks = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        chunks = ()
    if not chunks or min(chunks) < 1:
        raise UsageError(f"--chunks {value!r}: give chunk sizes like 1,256")
    return chunks


def streams_plan(runs: list[str] | None, lengths: tuple[int, ...], chunks: str, budget: str | None, **sizes):
    """The streams of `--only streams`: policy names only (each run is `h2o stream --policy NAME`)."""
    from h2o_cli.bench_streams import StreamsPlan

    if any(":" in spec for spec in runs or []):
        raise UsageError("--only streams: give --run a policy name (h2o stream's own options are not passed)")
    policies = tuple(runs) if runs else StreamsPlan.policies
    return StreamsPlan(policies=policies, lengths=lengths, chunks=parse_chunks(chunks), budget=budget or "0.1",
                       **sizes)  # fmt: skip


def paired_plan(old: Path | None, new: Path | None, **sizes):
    """The two checkouts of `--only paired` (`--new` defaults to the one running)."""
    import h2o_cli
    from h2o_cli.bench_paired import PairedPlan

    if old is None:
        raise UsageError("--only paired needs --old TREE: the checkout to measure against")
    new = new or Path(h2o_cli.__file__).resolve().parents[1]
    for tree in (old, new):
        if not (tree / "h2o_cli" / "__init__.py").is_file():
            raise UsageError(f"{tree} is not a checkout: it holds no h2o_cli/__init__.py")
    return PairedPlan(old=old.resolve(), new=new.resolve(), **sizes)


def check_runs(plan, parts: tuple[str, ...]) -> None:
    """Each `--run` spec names a policy and its fields (parsed now, so a typo stops before any model loads)."""
    from h2o_cli import bench as lib
    from h2o_cli.config import CacheSettings

    if lib.RECALL_PART not in parts:
        return
    for spec in plan.runs.runs:
        for context in plan.contexts:
            try:
                CacheSettings.from_spec(spec, budget=plan.budget_of(context), chunk=plan.chunk)
            except ValueError as error:
                raise UsageError(f"--run {spec!r}: {error}") from None


def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes: a few minutes.")] = False,
    flat_to: Annotated[
        int | None, typer.Option("--flat-to", min=2, help="Token of the flat-cost end point.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Markdown file whose bench section is rewritten.")
    ] = None,
    gguf: Annotated[
        Path | None,
        typer.Option(
            "--gguf", help="GGUF file to time under llama.cpp (default: the model's, when it is one)."
        ),
    ] = None,
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            help="Comma-separated parts: speed (plain transformers vs h2o decode), stream, floor (read and "
            "decode beside the matmul and bandwidth ceilings, and llama.cpp), policies, flat, prefill, "
            "llama_cpp. Default: all of these. On request: recall (cache settings against each "
            "other), paired (two checkouts' decode), streams (h2o stream per policy, chunk and length).",
        ),
    ] = None,
    contexts: Annotated[
        str | None,
        typer.Option(
            "--contexts", help="Comma-separated contexts of the decode parts (default 1024,4096,8000)."
        ),
    ] = None,
    rounds: Annotated[
        int | None,
        typer.Option(
            "--rounds",
            min=1,
            help="Rounds taking turns: speed (plain/h2o) and recall 2, paired 24 by default.",
        ),
    ] = None,
    decode: Annotated[
        int | None, typer.Option("--decode", min=1, help="Timed decode tokens (default 32; --quick 16).")
    ] = None,
    chunk: Annotated[
        int, typer.Option("--chunk", min=1, help="Tokens per forward pass of every read.")
    ] = 256,
    budget: Annotated[
        str | None,
        typer.Option(
            "--budget",
            help="recall, paired: tokens kept, a count or a fraction of each context; streams: of the "
            "context window (default 0.1).",
            rich_help_panel=RECALL_PANEL,
        ),
    ] = None,
    run: Annotated[
        list[str] | None,
        typer.Option(
            "--run",
            help="recall: a cache setting POLICY[:FIELD=VALUE,...], once per run; the first is the baseline "
            "(default: --run h2o --run recall). streams: a policy (default full, local, sink, h2o).",
            rich_help_panel=RECALL_PANEL,
        ),
    ] = None,
    block: Annotated[
        int | None,
        typer.Option(
            "--block",
            min=1,
            help="Decode tokens per turn (recall 8, paired 24).",
            rich_help_panel=RECALL_PANEL,
        ),
    ] = None,
    read_block: Annotated[
        int,
        typer.Option(
            "--read-block", min=1, help="recall: read tokens per turn.", rich_help_panel=RECALL_PANEL
        ),
    ] = 4096,
    question: Annotated[
        str | None,
        typer.Option(
            "--question",
            help="recall: end the read with this question, as `h2o stream --prompt` asks one.",
            rich_help_panel=RECALL_PANEL,
        ),
    ] = None,
    chunks: Annotated[
        str,
        typer.Option("--chunks", help="streams: comma-separated chunk sizes.", rich_help_panel=STREAMS_PANEL),
    ] = "1,256",
    max_chunk1_tokens: Annotated[
        int,
        typer.Option(
            "--max-chunk1-tokens",
            min=1,
            help="streams: most tokens a token-by-token run reads.",
            rich_help_panel=STREAMS_PANEL,
        ),
    ] = 10_000,
    old: Annotated[
        Path | None,
        typer.Option(
            "--old", help="paired: the checkout measured as the baseline.", rich_help_panel=PAIRED_PANEL
        ),
    ] = None,
    new: Annotated[
        Path | None,
        typer.Option(
            "--new",
            help="paired: the checkout measured against it (default: this one).",
            rich_help_panel=PAIRED_PANEL,
        ),
    ] = None,
    device: opt.Device = "cpu",
    dtype: opt.Dtype = "auto",
    device_map: opt.DeviceMap = None,
    kernels: opt.Kernels = "auto",
    data_dir: opt.DataDir = None,
    model: opt.Model = opt.DEFAULTS["model"],
    as_json: opt.Json = False,
    threads: opt.Threads = 1,
) -> None:
    """h2o vs plain transformers (decode at 1K/4K/8K with the byte-model ceiling, stream speed), read and
    decode beside the hardware's ceilings (the model's matmuls and the copy bandwidth, measured in the same
    run) and llama.cpp's on the same GGUF, decode vs our full cache, policy overhead, flat streaming cost, prefill memory (and llama.cpp). On request (--only):
    cache settings against each other in turns (recall), two checkouts' decode side by side (paired), `h2o
    stream` per policy, chunk and length in fresh processes (streams)."""
    from h2o_cli import bench as lib
    from h2o_cli.bench_recall import RunsPlan
    from h2o_cli.eval.data import data_dir as data_folder

    book = data_folder(data_dir) / lib.BOOK
    if not book.is_file():
        raise InputError(f"{book} not found: h2o bench reads War and Peace from the data folder")

    parts = parse_parts(only)
    plan = lib.BenchPlan.quick() if quick else lib.BenchPlan()
    plan = dataclasses.replace(plan, parts=parts, rounds=rounds or 2, kernels=kernels, chunk=chunk,
                               budget=budget, question=question)  # fmt: skip
    if decode is not None:
        plan = dataclasses.replace(plan, decode_tokens=decode)
    plan = dataclasses.replace(plan, runs=RunsPlan(runs=tuple(run or ("h2o", "recall")), decode=plan.decode_tokens,
                               block=block or 8, read_block=read_block, rounds=rounds or 2))  # fmt: skip
    if contexts is not None:
        plan = dataclasses.replace(plan, contexts=parse_contexts(contexts))
    if flat_to is not None:
        plan = dataclasses.replace(plan, flat_points=(min(plan.flat_points[0], flat_to // 2), flat_to))
    check_runs(plan, parts)
    if {"llama_cpp", "floor"} & set(parts) and gguf is None:
        from h2o_cli.models import resolve

        source = resolve(model)
        gguf = Path(source.location) if source.kind == "gguf" else None
    import torch

    lm = tokenizer = None
    if parts != ("paired",):  # the paired workers load their own
        lm, tokenizer = load(model, device, dtype, False, threads, device_map=device_map)
    elif threads:
        torch.set_num_threads(threads)
    if "streams" in parts:
        from h2o_cli.runtime import context_window

        plan = dataclasses.replace(plan, streams=streams_plan(run, plan.contexts, chunks, budget,
                                   chunk1_tokens=max_chunk1_tokens, window=context_window(lm), dtype=dtype))  # fmt: skip
    if "paired" in parts:
        sizes = dict(rounds=rounds or 24, block=block or 24, chunk=chunk, threads=torch.get_num_threads())
        plan = dataclasses.replace(plan, paired=paired_plan(old, new, model=model, book=book, **sizes))
    stderr.print(f"torch threads: {torch.get_num_threads()}; another process may share the CPU")
    report = lib.run(lm, tokenizer, model, plan, book, gguf, progress=lambda text: stderr.print(f"· {text}"))
    given = {"--contexts": contexts, "--rounds": rounds, "--decode": decode, "--chunk": chunk if chunk != 256 else None,
             "--budget": budget, "--block": block, "--read-block": read_block if lib.RECALL_PART in parts else None,
             "--question": shlex.quote(question) if question else None, "--old": old, "--new": new,
             "--chunks": chunks if "streams" in parts else None,
             "--max-chunk1-tokens": max_chunk1_tokens if "streams" in parts else None}  # fmt: skip
    command = " ".join(
        ["h2o bench"]
        + (["--quick"] if quick else [])
        + ([f"--only {','.join(parts)}"] if only else [])
        + [f"{name} {value}" for name, value in given.items() if value is not None]
        + [f"--run {shlex.quote(spec)}" for spec in run or []]
        + ([f"--device {device}"] if device != "cpu" else [])
        + ([f"--kernels {kernels}"] if kernels != "auto" else [])
        + [f"--threads {threads}"]
    )
    section = lib.markdown(report, command)
    if out is not None:
        lib.write_section(out, section)
        stderr.print(f"wrote {out}")
    if as_json:
        speed = {"speed": report.speed, "stream": report.stream, "bandwidth": report.bandwidth,
                 "recall": report.recall, "paired": report.paired, "streams": report.streams,
                 "floor": report.floor}  # fmt: skip
        print(json.dumps({"threads": report.threads, "rows": report.rows, "notes": report.notes, **speed}))
    else:
        stderr.print(section)


bench.__doc__ += EXAMPLES
