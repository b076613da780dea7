"""`h2o compare`: a perplexity table over budgets and policies for one text."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from h2o_cli.cli import options
from h2o_cli.cli.common import load, stderr
from h2o_cli.config import CacheSettings

EXAMPLES = """

A fractional budget here is a fraction of the tokens read (0.2 of 4096 tokens = 819 slots per head), the same
rule as `h2o eval` (a fraction of each prompt); `h2o stream`/`chat` take a fraction of the model's context
window instead. `full` is run once, with no eviction.

Examples:
  h2o compare book.txt --budgets 0.05,0.1,0.2,0.5 --policies local,sink,tova,h2o --max-tokens 20000
  h2o compare book.txt --max-tokens 4000 --json > ppl.json && h2o plot curve ppl.json --out figs/
  h2o compare book.txt --budgets 0.2 --policies full,h2o --quant 8bit --kv-bits 8 --max-tokens 2048
"""


@options.cache_options(skip=("budget", "policy"), budget=1.0, chunk=32)
def compare(
    settings: CacheSettings,
    file: Annotated[str, typer.Argument(help="Text file (or - for stdin).")],
    budgets: Annotated[
        str,
        typer.Option(
            "--budgets",
            help="Comma-separated budgets: a fraction <= 1 is of the tokens read (min of --max-tokens and the "
            "text), like eval's fraction of each prompt and unlike stream/chat (fraction of the context window); "
            "a number > 1 is a token count.",
        ),
    ] = "0.05,0.1,0.2,0.5",
    policies: Annotated[
        str, typer.Option("--policies", help="Comma-separated policies.")
    ] = "full,local,sink,tova,h2o",
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=2, help="Read at most this many tokens.")
    ] = 4096,
    model: options.Model = options.DEFAULTS["model"],
    device: options.Device = "auto",
    device_map: options.DeviceMap = None,
    dtype: options.Dtype = "auto",
    quant: options.Quant = "none",
    threads: options.Threads = 0,
    json_out: options.Json = False,
) -> None:
    """Perplexity of FILE's first --max-tokens tokens for every policy at every budget."""
    from rich.table import Table

    from h2o_cli.config import budget_value
    from h2o_cli.eval.compare import compare_perplexity
    from h2o_cli.textio import open_source

    fractions = [budget_value(value) for value in budgets.split(",") if value.strip()]
    chosen = options.parse_policies(policies)
    model_obj, tokenizer = load(model, device, dtype, False, threads, quant, device_map)
    with open_source(file) as stream:
        text = stream.read(max_tokens * 16).decode("utf-8", errors="replace").lstrip("\ufeff")
    ids = tokenizer(text)["input_ids"][:max_tokens]
    rows = compare_perplexity(
        model_obj,
        ids,
        fractions,
        chosen,
        settings,
        on_row=lambda row: stderr.print(f"[dim]{row['policy']} {row['budget']}: ppl {row['ppl']:.3f}[/]"),
    )
    table = Table(title=f"perplexity, {len(ids)} tokens, chunk {settings.chunk}")
    for name in ("policy", "budget", "budget_tokens", "ppl"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for row in rows:
        table.add_row(row["policy"], f"{row['budget']:g}", str(row["budget_tokens"]), f"{row['ppl']:.3f}")
    stderr.print(table)
    if json_out:
        print(json.dumps(rows))


compare.__doc__ = (compare.__doc__ or "") + EXAMPLES
