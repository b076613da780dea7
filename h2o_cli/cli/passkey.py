"""`h2o passkey`: the passkey grid (a needle in a long text, asked after it) under each policy and budget."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from h2o_cli.cli import options
from h2o_cli.cli.common import load, stderr
from h2o_cli.errors import UsageError

EXAMPLES = """
Examples:
  h2o passkey --lengths 4096 --depths 10 --seeds 3 --budgets 0.1 --policies full,h2o,recall --out grid.jsonl
  h2o passkey --lengths 32768 --depth-list 10,50,90 --seeds 1 --budgets 0.025 --policies recall --fork --out long.jsonl
  h2o passkey --lengths 1536 --needles 2 --budgets 0.1 --policies "recall;recall:lead_text=0" --out two.jsonl
  h2o passkey --lengths 2048 --haystack my_book.txt --policies h2o,recall --out book.jsonl
  h2o passkey --lengths 32768 --depths 5 --seeds 1 --budgets 0.025 --policies recall --wording door --haystack pride.txt --out report.jsonl
  h2o passkey --summary grid.jsonl long.jsonl      # the tables of earlier runs

Each run appends one JSON line to --out (a grid run again skips the runs the file holds, so an interrupted grid resumes; a run that failed, its answer "ERROR: ...", is run again and left out of the tables) and the tables of the whole file are printed on stdout at the end. A run is correct when the answer holds the passkey's digits. Budgets are fractions of each text's tokens; full runs once per haystack and only while the prompt fits the model's window.
"""


Haystack = Annotated[
    Path | None,
    typer.Option(
        "--haystack",
        help="Text file, or folder of *.txt, to cut haystacks from (default: the Paul Graham essays of the "
        "data folder).",
    ),
]


def read_haystack(haystack: Path | None, data_dir: Path | None) -> str:
    """The text haystacks are cut from: `--haystack`, else the essays of `--data-dir` / $H2O_DATA. Read before
    the model loads, so a missing one is one line and no wait."""
    from h2o_cli.eval.data import DATA_ENV
    from h2o_cli.eval.passkey import haystack_text

    if data_dir is not None:
        os.environ[DATA_ENV] = str(data_dir)
    return haystack_text(haystack)


def haystack_name(haystack: Path | None) -> str:
    """What rows record as the haystack: the file's or folder's name, `essays` for the default."""
    return "essays" if haystack is None else haystack.stem


def numbers(text: str, kind: type, option: str) -> tuple:
    """`1536,4096` -> (1536, 4096) of `kind`; a usage error naming `option` otherwise."""
    try:
        return tuple(kind(piece) for piece in text.split(",") if piece.strip())
    except ValueError as error:
        raise UsageError(f"{option} {text!r}: give comma-separated numbers ({error})") from error


def passkey(
    files: Annotated[
        list[Path] | None,
        typer.Argument(help="With --summary: JSON-lines files of earlier runs.", show_default=False),
    ] = None,
    summary: Annotated[
        bool, typer.Option("--summary", help="Print the tables of FILES (no model is loaded).")
    ] = False,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="JSON-lines file the runs are appended to.")
    ] = None,
    lengths: Annotated[
        str, typer.Option("--lengths", help="Prompt lengths in tokens, comma-separated.")
    ] = "1536",
    depths: Annotated[
        int, typer.Option("--depths", min=1, help="Needle depths, evenly spread (5 %..95 % for 10).")
    ] = 10,
    depth_list: Annotated[
        str | None,
        typer.Option("--depth-list", help="These depths (%, comma-separated) instead of --depths."),
    ] = None,
    seeds: Annotated[
        int, typer.Option("--seeds", min=1, help="Haystacks (text offset and passkey) per depth.")
    ] = 3,
    seed_from: Annotated[
        int, typer.Option("--seed-from", min=0, help="First seed (to split a grid over processes).")
    ] = 0,
    budgets: Annotated[
        str, typer.Option("--budgets", help="Budgets as fractions of the text's tokens, comma-separated.")
    ] = "0.05,0.1,0.2",
    policies: Annotated[
        str,
        typer.Option(
            "--policies",
            help="Run specs POLICY[:FIELD=VALUE,...], comma-separated (or ';'-separated).",
        ),
    ] = "full,h2o,sink,local,recall",
    chunk: options.Chunk = 256,
    needles: Annotated[
        int,
        typer.Option(
            "--needles",
            min=1,
            max=2,
            help="Passkeys per text: 2 hides a vault code at depth + 50 % and asks both.",
        ),
    ] = 1,
    via: Annotated[
        str,
        typer.Option(
            "--via", help="stream: ask as h2o stream --prompt does (in process); chat: through h2o chat."
        ),
    ] = "stream",
    fork: Annotated[
        bool,
        typer.Option(
            "--fork",
            help="Read each haystack's text before its needles once and fork a process per depth (same answers; "
            "one needle, --threads 1).",
        ),
    ] = False,
    wording: Annotated[
        str,
        typer.Option(
            "--wording",
            help="How the needle is said and asked: passkey (the wording recall's defaults were chosen on), "
            "page, door, phone, locker, secret or ticket (never used to choose a default).",
        ),
    ] = "passkey",
    answer_tokens: Annotated[
        int | None,
        typer.Option(
            "--answer-tokens",
            min=1,
            help="Most tokens an answer may take [default: 12; 16 each with --needles 2]: a wording the model "
            "answers as 'The answer to this question is: N' needs more than 12 for a 5-digit key.",
            show_default=False,
        ),
    ] = None,
    haystack: Haystack = None,
    data_dir: options.DataDir = None,
    model: options.Model = options.DEFAULTS["model"],
    device: options.Device = "cpu",
    dtype: options.Dtype = "float32",
    threads: options.Threads = 1,
) -> None:
    """Find a passkey hidden in a long text, asked after it: one JSON line per length, depth, seed, budget and policy."""
    from h2o_cli.config import split_run_specs
    from h2o_cli.eval.passkey_grid import Grid, even_depths, run_grid
    from h2o_cli.eval.passkey_grid import summary as tables

    if summary:
        if not files:
            raise UsageError("--summary needs the JSON-lines files to read")
        print(tables(files))
        return
    if files:
        raise UsageError("files are read with --summary; a grid writes to --out FILE")
    if out is None:
        raise UsageError("give --out FILE.jsonl: the runs are appended to it")
    grid = Grid(
        lengths=numbers(lengths, int, "--lengths"),
        depths=numbers(depth_list, int, "--depth-list") if depth_list else even_depths(depths),
        seeds=seeds,
        seed_from=seed_from,
        budgets=numbers(budgets, float, "--budgets"),
        policies=tuple(split_run_specs(policies)),
        chunk=chunk,
        needles=needles,
        via=via,
        fork=fork,
        threads=threads,
        wording=wording,
        haystack=haystack_name(haystack),
        answer_tokens=answer_tokens,
    )
    essays = read_haystack(haystack, data_dir)
    loaded, tokenizer = load(model, device, dtype, False, threads)

    def progress(row: dict) -> None:
        stderr.print(
            f"{row['length']} s{row['seed']} d{row['depth']:>2} {row['policy_spec']:<10} {row['budget']:<5} "
            f"{row['correct']!s:<5} {row['seconds']:6.2f}s {row['answer']!r}",
            markup=False,
        )

    run_grid(loaded, tokenizer, essays, grid, out, progress)
    print(tables([out]))


passkey.__doc__ = (passkey.__doc__ or "") + EXAMPLES
