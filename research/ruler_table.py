"""The RULER table of docs/results.md from `h2o lm-eval ... --log_samples --output_path DIR` runs: each task's
mean score per cell, its 95 % interval and n, and each cell's ratio to a baseline cell (`full` at 4K).

    python -m research.ruler_table full@4K=runs/full_4k recall@32K=runs/recall_32k_a,runs/recall_32k_b \
        --baseline full@4K

A cell is a name and one or more output folders (searched for lm-eval's `samples_<task>_<time>.jsonl`); a
document scored twice in a cell (a run repeated) counts once, its latest score. A document's score is
lm-eval's RULER metric at the document's own length (the other lengths' keys hold -1). The interval is
Wilson's when every score is 0 or 1, else a percentile bootstrap over documents (10,000 resamples, seed 0):
the multi-value tasks score the share of values found.

`--paired A,B` adds, per task, how many documents both cells scored and in how many A scored above B and
below it. `--keep DIR` writes each cell's samples files to DIR/NAME/ without the documents' text (lm-eval
logs each 32K-token document twice, ~6 MB a cell): what the table reads, small enough to keep in the tree,
and read back by this script like an output folder.
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


def samples(folders: list[Path]) -> dict[str, dict[int, dict]]:
    """{task: {doc_id: lm-eval sample}} of every samples file under `folders`, later files overriding
    earlier (a document answered twice counts once, its latest answer)."""
    paths = [path for folder in folders for path in folder.rglob("samples_*.jsonl")]
    found = [(match, path) for path in paths if (match := SAMPLES.search(path.name))]
    table: dict[str, dict[int, dict]] = defaultdict(dict)
    for match, path in sorted(found, key=lambda item: item[0]["time"]):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            table[match["task"]][row["doc_id"]] = row
    return dict(table)


def scores(folders: list[Path]) -> dict[str, dict[int, float]]:
    """{task: {doc_id: score}} of `samples(folders)`: lm-eval's metric at the document's own length."""
    return {
        task: {doc: float(row[str(row["doc"]["max_length"])]) for doc, row in rows.items()}
        for task, rows in samples(folders).items()
    }


def interval(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of the mean of `values`: Wilson's for 0/1 scores, else a percentile bootstrap."""
    if all(value in (0.0, 1.0) for value in values):
        return wilson_interval(sum(values) / len(values), len(values))
    rng = np.random.default_rng(seed)
    draws = rng.choice(np.asarray(values), size=(resamples, len(values))).mean(axis=1)
    return float(np.quantile(draws, 0.025)), float(np.quantile(draws, 0.975))


def paired(cells: dict[str, dict[str, dict[int, float]]], first: str, second: str) -> str:
    """One line per task both cells hold: the documents both scored, in how many `first` scored above
    `second` and below it, and both means over those documents."""
    lines = []
    for task in sorted(set(cells[first]) & set(cells[second])):
        a, b = cells[first][task], cells[second][task]
        both = sorted(set(a) & set(b))
        if not both:
            continue
        up = sum(a[doc] > b[doc] for doc in both)
        down = sum(a[doc] < b[doc] for doc in both)
        means = [sum(cell[doc] for doc in both) / len(both) for cell in (a, b)]
        lines.append(
            f"{task}: {first} {means[0]:.3f} vs {second} {means[1]:.3f} on the same {len(both)} documents; "
            f"{up} up, {down} down, {len(both) - up - down} equal"
        )
    return "\n".join(lines)


def keep(folders: list[Path], target: Path) -> int:
    """Copy the samples files under `folders` to `target`, each row without its document's text (`doc`'s
    `input`, `arguments`); returns the files written."""
    target.mkdir(parents=True, exist_ok=True)
    written = 0
    for path in (path for folder in folders for path in folder.rglob("samples_*.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            row = json.loads(line)
            row.pop("arguments", None)
            row["doc"] = {key: value for key, value in row["doc"].items() if key != "input"}
            rows.append(json.dumps(row))
        (target / path.name).write_text("\n".join(rows) + "\n")
        written += 1
    return written


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
    parser.add_argument("--paired", action="append", default=[], help="A,B: documents A scored above/below B")
    parser.add_argument("--keep", type=Path, help="write each cell's samples, text left out, to DIR/NAME/")
    args = parser.parse_args()
    cells = {}
    for spec in args.cells:
        name, _, folders = spec.partition("=")
        paths = [Path(folder) for folder in folders.split(",")]
        cells[name] = scores(paths)
        if args.keep:
            keep(paths, args.keep / re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_"))
    print(table(cells, args.baseline))
    for pair in args.paired:
        print(paired(cells, *pair.split(",")))


if __name__ == "__main__":
    main()
