"""`h2o plot`: PNG figures of the paper's observations and of budget-vs-quality results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from h2o_cli.cli import options
from h2o_cli.cli.common import load
from h2o_cli.errors import UsageError

EXAMPLES = """
Examples:
  h2o plot attention book.txt --out figs/        # sparsity.png, power_law.png, heavy_hitters.png
  h2o plot curve ppl.json --out figs/ --metric ppl  # from h2o compare --json (or h2o eval --json, --metric acc)
"""


def plot(
    kind: Annotated[
        str, typer.Argument(help="attention (from a text file) or curve (from a --json result file).")
    ],
    source: Annotated[str, typer.Argument(help="Text file for attention; JSON rows for curve.")],
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for the PNG files.")] = "figs",
    tokens: Annotated[
        int, typer.Option("--tokens", min=16, max=2048, help="Excerpt length for attention.")
    ] = 512,
    budget: Annotated[int, typer.Option("--budget", min=2, help="Heavy-hitter map budget (tokens).")] = 64,
    metric: Annotated[str, typer.Option("--metric", help="Row field to plot for curve.")] = "ppl",
    model: options.Model = options.DEFAULTS["model"],
    threads: options.Threads = 0,
) -> None:
    """Write PNG figures into --out and print their paths."""
    from h2o_cli import plots

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "curve":
        rows = json.loads(Path(source).read_text())
        if not isinstance(rows, list) or not rows:
            raise UsageError(f"{source} holds no result rows; give the output of h2o compare/eval --json")
        print(plots.plot_budget_curve(rows, folder / f"budget_{metric}.png", metric))
        return
    if kind != "attention":
        raise UsageError(f"plot kind {kind!r} is unknown; choose attention or curve")
    model_obj, tokenizer = load(model, "cpu", "float32", False, threads)
    text = Path(source).read_bytes()[: tokens * 16].decode("utf-8", errors="replace").lstrip("\ufeff")
    ids = tokenizer(text)["input_ids"][:tokens]
    maps = plots.attention_maps(model_obj, ids)
    print(plots.plot_sparsity(plots.sparsity_per_layer(maps), folder / "sparsity.png"))
    print(plots.plot_power_law(plots.accumulated_scores(maps), folder / "power_law.png"))
    print(
        plots.plot_heavy_hitters(plots.heavy_hitter_map(model_obj, ids, budget), folder / "heavy_hitters.png")
    )


plot.__doc__ = (plot.__doc__ or "") + EXAMPLES
