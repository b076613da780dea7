"""The RULER table of docs/results.md from `h2o lm-eval ... --log_samples --output_path DIR` runs: each task's
mean score per cell, its 95 % interval and n, and each cell's ratio to a baseline cell (`full` at 4K).

    python -m research.ruler_table full@4K=runs/full_4k recall@32K=runs/recall_32k_a,runs/recall_32k_b \
        --baseline full@4K

A cell is a name and one or more output folders (searched for lm-eval's `samples_<task>_<time>.jsonl`); a
document scored twice in a cell (a run repeated) counts once, its latest score. A document's score is
lm-eval's RULER metric at the document's own length (the other lengths' keys hold -1). The interval is
Wilson's when every score is 0 or 1, else a percentile bootstrap over documents (10,000 resamples, seed 0):
the multi-value tasks score the share of values found.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from h2o_cli.eval.scoring import wilson_interval

SAMPLES = re.compile(r"samples_(?P<task>.+)_(?P<time>\d{4}-\d\d-\d\dT[\d.-]+)\.jsonl$")


def scores(folders: list[Path]) -> dict[str, dict[int, float]]:
    """{task: {doc_id: score}} of every samples file under `folders`, later files overriding earlier."""
    paths = [path for folder in folders for path in folder.rglob("samples_*.jsonl")]
    found = [(match, path) for path in paths if (match := SAMPLES.search(path.name))]
    table: dict[str, dict[int, float]] = defaultdict(dict)
    for match, path in sorted(found, key=lambda item: item[0]["time"]):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            table[match["task"]][row["doc_id"]] = float(row[str(row["doc"]["max_length"])])
    return dict(table)


def interval(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of the mean of `values`: Wilson's for 0/1 scores, else a percentile bootstrap."""
    if all(value in (0.0, 1.0) for value in values):
        return wilson_interval(sum(values) / len(values), len(values))
    rng = np.random.default_rng(seed)
    draws = rng.choice(np.asarray(values), size=(resamples, len(values))).mean(axis=1)
    return float(np.quantile(draws, 0.025)), float(np.quantile(draws, 0.975))


def table(cells: dict[str, dict[str, dict[int, float]]], baseline: str | None) -> str:
    """A markdown table: a row per task, a column per cell (mean, interval, n), and `/ baseline` ratios."""
    tasks = sorted({task for cell in cells.values() for task in cell})
    others = [name for name in cells if name != baseline] if baseline else []
    head = ["task", *cells, *(f"{name} / {baseline}" for name in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task in tasks:
        row, means = [task], {}
        for name, cell in cells.items():
            values = list(cell.get(task, {}).values())
            if not values:
                row.append("–")
                continue
            means[name] = mean = sum(values) / len(values)
            low, high = interval(values)
            row.append(f"{mean:.2f} ({low:.2f}–{high:.2f}), n={len(values)}")
        for name in others:
            base = means.get(baseline)
            ok = name in means and base
            row.append(f"{means[name] / base:.2f}" if ok else "–")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "cells", nargs="+", help="NAME=FOLDER[,FOLDER...]: lm-eval output folders of one cell"
    )
    parser.add_argument("--baseline", help="the cell the ratio columns divide by (e.g. full@4K)")
    args = parser.parse_args()
    cells = {}
    for spec in args.cells:
        name, _, folders = spec.partition("=")
        cells[name] = scores([Path(folder) for folder in folders.split(",")])
    print(table(cells, args.baseline))


if __name__ == "__main__":
    main()
