"""Markdown tables of perplexity over long streams, from `h2o stream --ppl --json` files: one table per book.

Each file is one run, named `BOOK_POLICY_BUDGET.json` (`BUDGET` as given to `--budget`: a fraction of the window,
or a token count). Rows are policies, columns the fractions; a run whose budget is a token count (`local
32512`, `full 32768`) is a row of its own, its one figure in the first column. The best perplexity of each
column is bold; a missing run is "–". Nothing is typed in by hand.

    python -m research.stream_table docs/results/gemma3_stream100k
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

ORDER = ("sink", "tova", "recall", "h2o", "full", "local")


def load(folder: Path) -> dict[str, dict[tuple[str, str], dict]]:
    """book -> (policy, budget as written in the name) -> the run's JSON."""
    books: dict[str, dict[tuple[str, str], dict]] = defaultdict(dict)
    for path in sorted(folder.glob("*.json")):
        book, policy, budget = path.stem.rsplit("_", 2)
        books[book][policy, budget] = json.loads(path.read_text())
    return books


def table(runs: dict[tuple[str, str], dict]) -> list[str]:
    """One book's markdown rows."""
    fractions = sorted({b for _, b in runs if float(b) < 1}, key=float)
    counted = sorted({(p, b) for p, b in runs if float(b) >= 1}, key=lambda run: ORDER.index(run[0]))
    policies = sorted({p for p, b in runs if float(b) < 1}, key=ORDER.index)
    best = {b: min(runs[p, b]["ppl"] for p in policies if (p, b) in runs) for b in fractions}
    head = [
        f"{float(b):.0%} ({next(r for (_, c), r in runs.items() if c == b)['budget_tokens']:,})"
        for b in fractions
    ]
    lines = ["| policy | " + " | ".join(head) + " |", "|---" * (len(fractions) + 1) + "|"]
    for policy in policies:
        cells = []
        for b in fractions:
            run = runs.get((policy, b))
            cell = "–" if run is None else f"{run['ppl']:.3f}"
            cells.append(f"**{cell}**" if run is not None and run["ppl"] == best[b] else cell)
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    for policy, b in counted:
        run = runs[policy, b]
        cells = [f"{run['ppl']:.3f} (one run, not a fraction)"] + [""] * (len(fractions) - 1)
        lines.append(
            f"| {policy}, {run['budget_tokens']:,} tokens, over {run['tokens']:,} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    for book, runs in load(args.folder).items():
        tokens = {run["tokens"] for (_, b), run in runs.items() if float(b) < 1}
        print(f"**{book}** ({', '.join(f'{t:,}' for t in sorted(tokens))} tokens)\n")
        print("\n".join(table(runs)) + "\n")


if __name__ == "__main__":
    main()
