"""`h2o eval`: accuracy of tasks under each policy at a budget that is a fraction of every prompt."""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
from dataclasses import replace
from typing import Annotated

import typer

from h2o_cli.cli import options
from h2o_cli.cli.common import load, stderr
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError

EXAMPLES = """
Examples:
  h2o eval copa piqa openbookqa winogrande rte mathqa --budget 0.2 --policies full,local,sink,tova,h2o --shots 5
  h2o eval xsum --budget 0.2 --limit 200
  h2o eval hotpotqa kv-retrieval needle --budget 0.1 --limit 20
  h2o eval copa --data my_copa.xml --json > copa.json
  h2o eval copa piqa --policies full,h2o --quant 4bit --kv-bits 8 --limit 50
"""

COLUMNS = (
    "task",
    "policy",
    "budget",
    "budget_tokens_mean",
    "n",
    "acc",
    "acc_norm",
    "ci_low",
    "ci_high",
    "em",
    "rouge1",
    "rouge2",
    "rougeL",
    "length",
    "depth",
)


def _render(rows: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="h2o eval", title_style="bold")
    present = [name for name in COLUMNS if any(name in row for row in rows)]
    for name in present:
        table.add_column(name, justify="left" if name in ("task", "policy", "depth") else "right")
    for row in rows:
        table.add_row(*(_cell(row.get(name)) for name in present))
    stderr.print(table)


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _quiet() -> None:
    """Silence lm-eval's, datasets' and transformers' log lines and progress bars (all on stderr).

    tqdm reads $TQDM_DISABLE only when it is first imported, and lm-eval passes `disable=` explicitly, so the
    bars are switched off in tqdm itself (this process only: the command line, not the library).
    """
    import tqdm

    os.environ["TQDM_DISABLE"] = "1"
    original = tqdm.tqdm.__init__
    if not getattr(original, "_h2o_quiet", False):

        def quiet_init(self, *args, **kwargs):
            kwargs["disable"] = True
            original(self, *args, **kwargs)

        quiet_init._h2o_quiet = True
        tqdm.tqdm.__init__ = quiet_init
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    for name in ("lm_eval", "lm-eval", "datasets", "transformers", "evaluate", "absl"):
        logging.getLogger(name).setLevel(logging.ERROR)


@options.cache_options(skip=("policy",), options={"budget": options.PromptBudget}, budget="0.2")
def eval(  # noqa: A001 - the command is called eval
    settings: CacheSettings,
    tasks: Annotated[
        list[str],
        typer.Argument(
            help="copa piqa openbookqa winogrande rte mathqa xsum hotpotqa "
            "kv-retrieval needle, or any lm-eval task name / YAML path."
        ),
    ],
    policies: Annotated[
        str, typer.Option("--policies", help="Comma-separated policies to compare.")
    ] = "full,local,h2o",
    shots: Annotated[
        int, typer.Option("--shots", min=0, help="Few-shot examples per prompt (harness tasks).")
    ] = 0,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="At most this many examples per task.")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed for few-shot sampling.")] = 1234,
    data: Annotated[
        str | None, typer.Option("--data", help="Use this file (same format) instead of the shared copy.")
    ] = None,
    model: options.Model = options.DEFAULTS["model"],
    device: options.Device = "auto",
    dtype: options.Dtype = "auto",
    quant: options.Quant = "none",
    threads: options.Threads = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON list of rows on stdout.")] = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="Print the rows as CSV on stdout.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", help="Keep lm-eval's log lines and progress bars on stderr.")
    ] = False,
) -> None:
    """Score tasks through the H2O cache for each policy: accuracy with 95% CIs and the real budget in tokens."""
    from h2o_cli.eval.long_tasks import LONG_TASKS

    chosen = options.parse_policies(policies)
    if not verbose:
        _quiet()
    try:
        from h2o_cli.eval.lm_eval_model import H2OLM
        from h2o_cli.eval.runner import run_harness, run_long
    except ImportError as error:
        raise UsageError(f"h2o eval needs the eval extra (pip install 'h2o-cli[eval]'): {error}") from error

    loaded = load(model, device, dtype, False, threads, quant)
    lm = H2OLM(model=loaded)
    rows: list[dict] = []
    for task in tasks:
        for policy in chosen:
            spec = replace(settings, policy=policy)
            stderr.print(f"[dim]{task} · {policy} · budget {settings.budget}[/]")
            if task in LONG_TASKS:
                found = run_long(loaded[0], loaded[1], task, spec, limit, data)
            else:
                found = [run_harness(lm, task, spec, limit, shots, seed, data)]
            rows.extend({**row, "quant": quant} for row in found)
    _render(rows)
    if json_out:
        print(json.dumps(rows))
    elif csv_out:
        names = [name for name in COLUMNS if any(name in row for row in rows)]
        names += sorted({key for row in rows for key in row} - set(names))
        writer = csv.DictWriter(sys.stdout, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)


eval.__doc__ = (eval.__doc__ or "") + EXAMPLES
