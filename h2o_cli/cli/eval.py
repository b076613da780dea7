"""`h2o eval`: accuracy of tasks under each policy at a budget that is a fraction of every prompt."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import sys
from dataclasses import dataclass, replace
from typing import Annotated

import typer

from h2o_cli.cli import options
from h2o_cli.cli.common import load, stderr
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError

EXAMPLES = """

Examples:

  h2o eval copa piqa openbookqa winogrande rte mathqa --budget 0.2 --policies full,local,sink,tova,h2o --shots 5
  h2o eval rte --shots 5 --limit 200 --policies full,h2o,recall --processes 2 --threads 1 --json > rte.json
  H2O_DATA=~/h2o-data h2o eval xsum --budget 0.2 --limit 200
  h2o eval hotpotqa kv-retrieval needle --budget 0.1 --limit 20 --data-dir ~/h2o-data
  h2o eval copa --data my_copa.xml --json > copa.json
  h2o eval copa piqa --policies full,h2o --quant 4bit --kv-bits 8 --limit 50

With `full` among the policies, every other policy's row also has its paired difference
from `full` on the same examples: Δ accuracy with a 95% paired-bootstrap interval, the
examples only one of them got right (lost/gained) and McNemar's exact p. JSON: delta_vs_full,
delta_low, delta_high, discordant, mcnemar_p, and each example's outcome in `correct`.
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
    "delta_vs_full",
    "delta_low",
    "delta_high",
    "discordant",
    "mcnemar_p",
    "em",
    "rouge1",
    "rouge2",
    "rougeL",
    "length",
    "depth",
)


# The paired difference from full fills one column of the table, its discordant counts another.
HEADERS = {"delta_vs_full": "Δ full [95%]", "discordant": "lost/gained", "mcnemar_p": "p"}
IN_DELTA = ("delta_low", "delta_high")


def _render(rows: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="h2o eval", title_style="bold")
    present = [name for name in COLUMNS if name not in IN_DELTA and any(name in row for row in rows)]
    for name in present:
        justify = "left" if name in ("task", "policy", "depth") else "right"
        table.add_column(HEADERS.get(name, name), justify=justify)
    for row in rows:
        table.add_row(*(_display(row, name) for name in present))
    stderr.print(table)


def _display(row: dict, name: str) -> str:
    value = row.get(name)
    if name == "delta_vs_full" and value is not None:
        return f"{value:+.3f} [{row['delta_low']:+.3f}, {row['delta_high']:+.3f}]"
    if name == "discordant" and value is not None:
        return "/".join(map(str, value))
    return _cell(value)


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _quiet() -> None:
    """Silence lm-eval's, datasets' and transformers' log lines and progress bars (all on stderr), each through
    its own switch. tqdm reads $TQDM_DISABLE when it is imported (here: already, by transformers), so it reaches
    only our lm-eval model's bars and processes started from here; lm-eval's own bars have no switch: see
    `_lm_eval_output`."""
    import huggingface_hub.utils
    import transformers

    os.environ["TQDM_DISABLE"] = "1"
    try:  # the `eval` extra; the long tasks (hotpotqa, kv-retrieval, needle) run without it
        import datasets
    except ImportError:
        pass
    else:
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    huggingface_hub.utils.disable_progress_bars()
    for name in ("lm_eval", "lm-eval", "evaluate", "absl"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _lm_eval_output(verbose: bool):
    """Where lm-eval's stderr goes while it runs a task: nowhere unless --verbose (errors still raise)."""
    return contextlib.nullcontext() if verbose else contextlib.redirect_stderr(io.StringIO())


@dataclass(frozen=True)
class _Job:
    """What every process of `h2o eval` scores (picklable, for --processes)."""

    load_args: tuple
    tasks: list[str]
    policies: list[str]
    settings: CacheSettings
    limit: int | None
    shots: int
    seed: int
    data: str | None
    quant: str
    verbose: bool


def _score(job: _Job) -> list[dict] | None:
    """Rows of every task x policy; in one of several processes (`--processes`), rank 0's rows of all the
    examples and None on the others (which score their share and stay quiet)."""
    from h2o_cli.eval.lm_eval_model import H2OLM, join_processes
    from h2o_cli.eval.long_tasks import LONG_TASKS
    from h2o_cli.eval.runner import run_harness, run_long

    load_args = job.load_args
    rank, world = join_processes(load_args[1])
    if world > 1:
        if not job.verbose:
            _quiet()
        import torch

        if str(load_args[1]).startswith(("cuda", "auto")) and torch.cuda.is_available():
            load_args = (load_args[0], f"cuda:{rank % torch.cuda.device_count()}", *load_args[2:])
    loaded = load(*load_args)
    lm = H2OLM(model=loaded)
    rows: list[dict] = []
    for task in job.tasks:
        for policy in job.policies:
            spec = replace(job.settings, policy=policy)
            if rank == 0:
                stderr.print(f"[dim]{task} · {policy} · budget {job.settings.budget}[/]")
            if task in LONG_TASKS:
                found = run_long(loaded[0], loaded[1], task, spec, job.limit, job.data)
            else:
                with _lm_eval_output(job.verbose):
                    found = [run_harness(lm, task, spec, job.limit, job.shots, job.seed, job.data)]
            rows.extend({**row, "quant": job.quant} for row in found if row is not None)
    return rows if rank == 0 else None


@options.cache_options(skip=("policy",), options={"budget": options.PromptBudget}, budget="0.2")
def eval(  # noqa: A001 - the command is called eval
    settings: CacheSettings,
    tasks: Annotated[
        list[str],
        typer.Argument(
            help="copa piqa openbookqa winogrande rte mathqa xsum hotpotqa "
            "kv-retrieval needle, or any lm-eval task name / YAML path. copa scores COPA's 100 "
            "validation items (shots from the 400 training ones); copa_all all 500 labelled ones, "
            "each with shots from the other 499."
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
    data_dir: options.DataDir = None,
    model: options.Model = options.DEFAULTS["model"],
    device: options.Device = "auto",
    device_map: options.DeviceMap = None,
    dtype: options.Dtype = "auto",
    quant: options.Quant = "none",
    threads: options.Threads = 0,
    json_out: Annotated[
        bool,
        typer.Option("--json", help="Print one JSON list of rows on stdout.", rich_help_panel=options.OUTPUT),
    ] = False,
    csv_out: Annotated[
        bool, typer.Option("--csv", help="Print the rows as CSV on stdout.", rich_help_panel=options.OUTPUT)
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            help="Keep lm-eval's log lines and progress bars on stderr.",
            rich_help_panel=options.OUTPUT,
        ),
    ] = False,
    processes: Annotated[
        int,
        typer.Option(
            "--processes",
            min=1,
            help="Split each lm-eval task's examples over this many processes, each with its own model and "
            "cache (set --threads for each); the metrics equal one process's.",
            rich_help_panel=options.SPEED,
        ),
    ] = 1,
) -> None:
    """Score tasks through the H2O cache for each policy: accuracy with 95% CIs and the real budget in tokens."""
    from h2o_cli.eval.data import DATA_ENV
    from h2o_cli.eval.data import data_dir as data_folder
    from h2o_cli.eval.long_tasks import LONG_TASKS

    chosen = options.parse_policies(policies)
    if not verbose:
        _quiet()
    try:
        from h2o_cli.eval.lm_eval_model import H2OLM  # noqa: F401 - lm-eval present
        from h2o_cli.eval.runner import HARNESS_TASKS, pair_with_full
    except ImportError as error:
        raise UsageError(f"h2o eval needs the eval extra (pip install 'h2o-cli[eval]'): {error}") from error

    if data_dir is not None:  # lm-eval calls the task loaders itself: the folder travels in the environment
        os.environ[DATA_ENV] = str(data_dir)
    if data is None and any(task in HARNESS_TASKS or task in LONG_TASKS for task in tasks):
        data_folder()  # no data folder: one line before the model loads, not after
    job = _Job(
        (model, device, dtype, False, threads, quant, device_map),
        tasks, chosen, settings, limit, shots, seed, data, quant, verbose,
    )  # fmt: skip
    if processes > 1:
        if any(task in LONG_TASKS for task in tasks):
            raise UsageError(f"--processes splits lm-eval tasks; run {', '.join(LONG_TASKS)} in one process")
        from h2o_cli.eval.processes import run_processes

        rows = run_processes(processes, _score, job)
    else:
        rows = _score(job)
    pair_with_full(rows)
    _render(rows)
    if json_out:
        print(json.dumps(rows))
    elif csv_out:
        names = [name for name in COLUMNS if any(name in row for row in rows)]
        names += sorted({key for row in rows for key in row} - set(names) - {"correct"})  # per example: JSON
        writer = csv.DictWriter(sys.stdout, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(
            {key: _display(row, key) if key == "discordant" else value for key, value in row.items()}
            for row in rows
        )


eval.__doc__ = (eval.__doc__ or "") + EXAMPLES
