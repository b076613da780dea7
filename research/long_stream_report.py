"""Tables and figures for the 100,000-token streams (docs/results.md), from `research/heavy_age.py` JSON files.

Each file is one (book, budget): `DIR/BOOK_BUDGET.json`, every run of it sampled every 10,000 tokens (PPL so
far, PPL of the last window, what the heavy slots hold). Prints markdown on stdout; writes the PPL-over-stream
figure and the heavy-slot age figure.

    python -m research.long_stream_report --dir docs/results/stream100k --figs docs/figs
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

LABELS = {
    "h2o": "h2o (paper)",
    "sink": "sink (StreamingLLM)",
    "local": "local",
    "h2o:score_decay=0.999": "h2o, --score-decay 0.999",
    "h2o:score_decay=0.999,heavy_ratio=0.25": "h2o, --score-decay 0.999 --heavy-ratio 0.25",
    "recall:archive_max=131072": "recall (page 8, ratio 0.5), --archive-max 131072",
}


def label(spec: str) -> str:
    if spec in LABELS:
        return LABELS[spec]
    policy, _, rest = spec.partition(":")
    flags = " ".join(f"--{pair.replace('_', '-').replace('=', ' ')}" for pair in rest.split(",") if pair)
    return f"{policy}, {flags}" if flags else policy


def load(folder: Path) -> dict[str, dict[int, dict]]:
    """book -> budget -> the file's report."""
    books: dict[str, dict[int, dict]] = defaultdict(dict)
    for path in sorted(folder.glob("*_pg*_*.json")):
        book, _, budget = path.stem.rpartition("_")
        books[book][int(budget)] = json.loads(path.read_text())
    return books


def tables(books: dict[str, dict[int, dict]]) -> str:
    lines = []
    for book, by_budget in books.items():
        budgets = sorted(by_budget)
        specs = list(dict.fromkeys(spec for b in budgets for spec in by_budget[b]["runs"]))
        first = by_budget[budgets[0]]
        lines += [
            f"\n**{book}** ({first['tokens']:,} tokens, chunk {first['chunk']}, {first.get('device', 'cpu')}, "
            f"{first.get('dtype', 'torch.float32')}; PPL over the whole stream, bold = best at that budget)\n",
            "| policy | " + " | ".join(f"{b} tok ({b / 8192:.0%})" for b in budgets) + " |",
            "|---|" + "---|" * len(budgets),
        ]
        best = {b: min(run[-1]["ppl"] for run in by_budget[b]["runs"].values()) for b in budgets}
        for spec in specs:
            cells = []
            for b in budgets:
                run = by_budget[b]["runs"].get(spec)
                if run is None or run[-1]["tokens"] < first["tokens"]:
                    cells.append("–")
                    continue
                ppl = run[-1]["ppl"]
                cells.append(f"**{ppl:.3f}**" if ppl == best[b] else f"{ppl:.3f}")
            lines.append(f"| {label(spec)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def age_table(books: dict[str, dict[int, dict]], budget: int) -> str:
    lines = [
        f"\n**What the heavy slots hold at the end of the stream** (budget {budget}; mean over layers and heads)\n",
        "| book | run | heavy mean age | heavy median age | first 4 tokens held | latest attention on heavy |",
        "|---|---|---|---|---|---|",
    ]
    for book, by_budget in books.items():
        for spec, run in by_budget[budget]["runs"].items():
            end = run[-1]
            if end.get("heavy_mean_age") is None or spec == "sink":
                continue
            lines.append(
                f"| {book} | {label(spec)} | {end['heavy_mean_age']:,.0f} | {end['heavy_median_age']:,.0f} "
                f"| {end['sinks_kept']:.2f} | {end['heavy_attention_share']:.0%} |"
            )
    return "\n".join(lines)


def figures(books: dict[str, dict[int, dict]], figs: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs.mkdir(parents=True, exist_ok=True)
    budgets = sorted({b for by_budget in books.values() for b in by_budget})
    figure, axes = plt.subplots(len(books), len(budgets), figsize=(5 * len(budgets), 3.6 * len(books)))
    for row, (book, by_budget) in enumerate(books.items()):
        for col, budget in enumerate(budgets):
            ax = axes[row][col]
            for spec, run in by_budget.get(budget, {"runs": {}})["runs"].items():
                if spec == "local":
                    continue  # twice the others' PPL: it would flatten every other line
                ax.plot(
                    [s["tokens"] for s in run], [s["window_ppl"] for s in run], marker=".", label=label(spec)
                )
            ax.set(
                title=f"{book}, budget {budget}", xlabel="tokens read", ylabel="PPL of the last 10K tokens"
            )
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    figure.tight_layout()
    ppl_path = figs / "stream100k_ppl.png"
    figure.savefig(ppl_path, dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(1, len(books), figsize=(5 * len(books), 3.8))
    for ax, (book, by_budget) in zip(axes, books.items(), strict=True):
        for spec, run in by_budget[budgets[0]]["runs"].items():
            if run[-1].get("heavy_mean_age") is None or spec == "sink":
                continue
            ax.plot(
                [s["tokens"] for s in run], [s["heavy_mean_age"] for s in run], marker=".", label=label(spec)
            )
        tokens = [s["tokens"] for s in next(iter(by_budget[budgets[0]]["runs"].values()))]
        ax.plot(tokens, [t - 1 for t in tokens], "k:", lw=1, label="age of token 0")
        ax.set(title=f"{book}, budget {budgets[0]}", xlabel="tokens read", ylabel="mean age of heavy entries")
        ax.legend(fontsize=7)
    figure.tight_layout()
    age_path = figs / "stream100k_heavy_age.png"
    figure.savefig(age_path, dpi=100)
    plt.close(figure)
    return [ppl_path, age_path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("docs/results/stream100k"))
    parser.add_argument("--figs", type=Path, default=None, help="write the two figures here")
    args = parser.parse_args()
    books = load(args.dir)
    print(tables(books))
    print(age_table(books, min(next(iter(books.values())))))
    if args.figs:
        for path in figures(books, args.figs):
            print(f"\n![{path.stem}](figs/{path.name})")


if __name__ == "__main__":
    main()
