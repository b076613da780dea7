"""`h2o calibrate`: rank a model's KV heads by their attention on a planted fact while the answer copies it, name
the lead head, and keep it for `--recall-lead auto` (`$H2O_HOME/calibration/`, keyed by the weights)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from h2o_cli.cli import options
from h2o_cli.cli.common import load, stderr

EXAMPLES = """
Examples:
  h2o calibrate                                  # the embedded model: kept, or found now (12 probes)
  h2o calibrate --force                          # find it again
  h2o calibrate --model gemma3-270m --json > heads.json

The probes (h2o_cli/eval/probes.py, the tuning set) plant a number, a word or a UUID in a novel of the data folder or a list of random words, with varied needle and question wordings, each inside the model's window. Each is read with a plain full cache and answered greedily; at each answer step that writes the next piece of the value, each query head's attention mass on the needle's tokens is summed over the heads that share a KV head. A KV head scores that mass per piece, over the probes the model answers; the best head of a global layer leads (`--recall-lead auto`; a sliding-window layer takes no lead). The result is kept under a hash of the weights, so a renamed copy of the model finds it; `h2o models` shows it.
"""


def calibrate(
    force: Annotated[
        bool, typer.Option("--force", help="Calibrate again even where a calibration is kept.")
    ] = False,
    probes: Annotated[int, typer.Option("--probes", min=1, help="Tuning probes read.")] = 12,
    length: Annotated[
        int, typer.Option("--length", min=64, help="Tokens per probe (inside the model's window).")
    ] = 1024,
    top: Annotated[int, typer.Option("--top", min=1, help="KV heads shown in the ranking.")] = 10,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Also write the whole report (runs, scores) here.")
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the whole report as JSON on stdout.")
    ] = False,
    data_dir: options.DataDir = None,
    model: options.Model = options.DEFAULTS["model"],
    threads: options.Threads = 1,
) -> None:
    """Find the model's lead head (the KV head that reads planted facts most while copying them) and keep it for --recall-lead auto."""
    from h2o_cli.models import calibration

    loaded, tokenizer = load(model, "cpu", "float32", False, threads)
    report = None if force else calibration.load(loaded)
    if report is None:
        report = _run(calibration, loaded, tokenizer, data_dir, probes, length, model)
    else:
        stderr.print(f"kept calibration: {calibration.cache_file(report['fingerprint'])} (--force to redo)")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
    if json_out:
        print(json.dumps(report))
        return
    print(
        f"{model}: {report['answered']} of {len(report['runs'])} probes answered, {report['copied']} value "
        f"pieces scored, {report['seconds']:g} s"
    )
    if report["lead"] is None:
        print(
            "no head of a global layer attended to the needle while an answer copied it: no lead "
            "(--recall-lead auto keeps each head's own choice)"
            if report["answered"]
            else "no probe answered: no head can be ranked (try a shorter --length or more --probes)"
        )
        return
    print("layer  kv head  score")
    for row in report["ranked"][:top]:
        print(f"{row['layer']:>5}  {row['kv_head']:>7}  {row['score']:.2f}")
    layer, head = report["lead"]
    print(f"lead head: {layer}.{head} (what --recall-lead auto takes for these weights)")


def _run(calibration, loaded, tokenizer, data_dir, probes: int, length: int, model: str) -> dict:
    """Calibrate with a progress bar on stderr (one line per probe when stderr is not a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("[bold]calibrating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=stderr,
        disable=not sys.stderr.isatty(),
    )
    with bar:
        task = bar.add_task("probes", total=probes, status="")

        def progress(done: int, count: int, row: dict) -> None:
            status = f"{row['kind']} in {row['filler']}: {'answered' if row['correct'] else 'missed'}"
            bar.update(task, completed=done, status=status)
            if not sys.stderr.isatty():
                stderr.print(f"{done}/{count} {status} {row['answer']!r}", markup=False)

        return calibration.run(
            loaded, tokenizer, calibration.data_folder(data_dir), progress, probes, length, model
        )


calibrate.__doc__ = (calibrate.__doc__ or "") + EXAMPLES
