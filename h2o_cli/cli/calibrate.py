"""`h2o calibrate`: rank a model's KV heads by how often they copy a passkey, and name the lead head."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from h2o_cli.cli import options
from h2o_cli.cli.common import load, stderr
from h2o_cli.cli.passkey import Haystack, read_haystack

EXAMPLES = """
Examples:
  h2o calibrate                                  # the embedded model, 15 passkey haystacks of 2,048 tokens
  h2o calibrate --length 2048 --seeds 2 --depths 4 --out heads.json
  h2o calibrate --model smollm2-360m --haystack my_book.txt --json > heads.json

Each haystack must fit the model's window: it is read with a plain full cache and answered greedily. At each answer step that writes the passkey's next digit, a query head copies when its strongest key is a token of the needle holding that digit; a KV head scores the share of digits its best query head copied, over the runs the model answers. The best-ranked head is what `--recall-lead LAYER.HEAD` takes (`auto` names it for a calibrated preset).
"""


def calibrate(
    length: Annotated[
        int, typer.Option("--length", min=64, help="Prompt tokens per haystack (inside the model's window).")
    ] = 2048,
    depths: Annotated[int, typer.Option("--depths", min=1, help="Needle depths, from 5 % to 95 %.")] = 5,
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="Haystacks per depth.")] = 3,
    seed_from: Annotated[
        int, typer.Option("--seed-from", min=0, help="First seed (apart from h2o passkey's 0-2).")
    ] = 100,
    top: Annotated[int, typer.Option("--top", min=1, help="KV heads shown in the ranking.")] = 15,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write the whole report (runs, scores, ranking) here.")
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the whole report as JSON on stdout.")
    ] = False,
    haystack: Haystack = None,
    data_dir: options.DataDir = None,
    model: options.Model = options.DEFAULTS["model"],
    threads: options.Threads = 1,
) -> None:
    """Rank the model's KV heads by retrieval score (the copy-paste score) and name the lead head recall would take."""
    from h2o_cli.eval.retrieval_heads import calibrate as run

    essays = read_haystack(haystack, data_dir)
    loaded, tokenizer = load(model, "cpu", "float32", False, threads)

    def progress(row: dict) -> None:
        stderr.print(
            f"s{row['seed']} d{row['depth']:>2} {row['correct']!s:<5} {row['answer']!r}", markup=False
        )

    report = run(loaded, tokenizer, essays, length, depths, seeds, seed_from, progress)
    best = report["ranked"][0] if report["copied_digits"] else None
    report = {"model": model, **report, "lead": f"{best['layer']}.{best['kv_head']}" if best else None}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
    if json_out:
        print(json.dumps(report))
        return
    answered = sum(run["correct"] for run in report["runs"])
    print(
        f"{model}: {answered} of {len(report['runs'])} runs answered, {report['copied_digits']} digits scored"
    )
    if best is None:
        print("no run answered: no head can be ranked (try a shorter --length or more --seeds)")
        return
    print("layer  kv head  score")
    for row in report["ranked"][:top]:
        print(f"{row['layer']:>5}  {row['kv_head']:>7}  {row['score']:.2f}")
    print(f"lead head: {report['lead']} (--recall-lead {report['lead']})")


calibrate.__doc__ = (calibrate.__doc__ or "") + EXAMPLES
