"""Markdown tables and the budget-vs-quality figure for docs/results.md, from the JSON files `make results` writes.

    python -m research.results_tables --out docs/results --figs docs/figs > /tmp/tables.md

Every number printed is read from a JSON file in --out; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

POLICY_ORDER = ("full", "local", "sink", "tova", "h2o", "recall")
TASK_ORDER = ("copa", "copa_all", "piqa", "openbookqa", "winogrande", "rte", "mathqa")


def _load(path: Path) -> list[dict]:
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    return rows if isinstance(rows, list) else []


def _policies(rows: list[dict]) -> list[str]:
    present = {row["policy"] for row in rows}
    return [name for name in POLICY_ORDER if name in present]


def ppl_tables(out: Path) -> tuple[str, dict[str, list[dict]]]:
    books = {path.stem.removeprefix("ppl_"): _load(path) for path in sorted(out.glob("ppl_*_pg*.json"))}
    books = {name: rows for name, rows in books.items() if rows}
    lines = []
    for name, rows in books.items():
        budgets = sorted({row["budget"] for row in rows if row["policy"] != "full"})
        tokens = rows[0]["tokens"]
        full = next((row["ppl"] for row in rows if row["policy"] == "full"), None)
        lines.append(f"**{name}** ({tokens} tokens scored, full attention ppl {full:.3f})\n")
        header = " | ".join(
            f"{b:g} ({next(r['budget_tokens'] for r in rows if r['budget'] == b and r['policy'] != 'full')} tok)"
            for b in budgets
        )
        lines.append(f"| policy | {header} |")
        lines.append("|---" * (len(budgets) + 1) + "|")
        for policy in _policies(rows):
            if policy == "full":
                continue
            cells = []
            for budget in budgets:
                values = [r["ppl"] for r in rows if r["policy"] == policy and r["budget"] == budget]
                best = min(r["ppl"] for r in rows if r["policy"] != "full" and r["budget"] == budget)
                cell = f"{values[0]:.3f}" if values else "–"
                cells.append(f"**{cell}**" if values and values[0] == best else cell)
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines), books


def norm_table(out: Path, books: dict[str, list[dict]]) -> str:
    mean_rows = _load(out / "norm_mean.json")
    if not mean_rows or not books:
        return "(norm_mean.json missing)"
    name, rows = next(iter(books.items()))
    lines = [f"| budget | h2o, score-norm sum | h2o, score-norm mean | ({name}) |", "|---|---|---|---|"]
    for row in sorted(mean_rows, key=lambda r: r["budget"]):
        total = [r["ppl"] for r in rows if r["policy"] == "h2o" and r["budget"] == row["budget"]]
        lines.append(
            f"| {row['budget']:g} ({row['budget_tokens']} tok) | {total[0]:.3f} | {row['ppl']:.3f} | |"
            if total
            else f"| {row['budget']:g} | – | {row['ppl']:.3f} | |"
        )
    return "\n".join(lines)


def _task_rows(paths) -> list[dict]:
    rows = [row for path in sorted(paths) for row in _load(path)]
    rank = {name: number for number, name in enumerate(TASK_ORDER)}
    return sorted(rows, key=lambda row: rank.get(row["task"], len(rank)))


def paired_task_tables(out: Path) -> str:
    """The 5-shot table (tasks20_5shot_*.json): accuracy per policy, then each policy's paired difference
    from full on the same examples (bootstrap interval, discordant counts, McNemar's p; bold where p < 0.05)."""
    rows = _task_rows(out.glob("tasks20_5shot_*.json"))
    if not rows:
        return "(no tasks20_5shot_*.json)"
    policies = _policies(rows)
    tasks = list(dict.fromkeys(row["task"] for row in rows))

    def row_of(task: str, policy: str) -> dict | None:
        return next((r for r in rows if r["task"] == task and r["policy"] == policy), None)

    lines = [
        "| task | n | mean prompt (tok) | mean budget (tok) | " + " | ".join(policies) + " |",
        "|---|---|---|---|" + "---|" * len(policies),
    ]
    for task in tasks:
        full, h2o = row_of(task, "full"), row_of(task, "h2o")
        cells = [
            f"{r['acc']:.3f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]" if r else "–"
            for r in (row_of(task, policy) for policy in policies)
        ]
        n = next(r["n"] for r in rows if r["task"] == task)
        prompt = full["budget_tokens_mean"] if full else "–"
        budget = h2o["budget_tokens_mean"] if h2o else "–"
        lines.append(f"| {task} | {n} | {prompt} | {budget} | " + " | ".join(cells) + " |")
    others = [policy for policy in policies if policy != "full"]
    lines += [
        "",
        "Paired difference from `full` on the same examples: Δ accuracy [95 % paired-bootstrap interval], "
        "lost/gained (examples right under full only / under the policy only), McNemar's exact p:\n",
        "| task | " + " | ".join(others) + " |",
        "|---|" + "---|" * len(others),
    ]
    for task in tasks:
        cells = []
        for policy in others:
            r = row_of(task, policy)
            if not r or "delta_vs_full" not in r:
                cells.append("–")
                continue
            lost, gained = r["discordant"]
            text = f"{r['delta_vs_full']:+.3f} [{r['delta_low']:+.3f}, {r['delta_high']:+.3f}]"
            text = f"**{text}**" if r["mcnemar_p"] < 0.05 else text
            cells.append(f"{text} {lost}/{gained}, p={r['mcnemar_p']:.2f}")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    lines += ["", "acc_norm (length-normalised), same runs:\n"]
    lines += ["| task | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    for task in tasks:
        cells = [
            f"{r['acc_norm']:.3f}" if r and "acc_norm" in r else "–"
            for r in (row_of(task, policy) for policy in policies)
        ]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def task_table(out: Path) -> str:
    rows = [
        row
        for path in sorted(out.glob("tasks20_*.json"))
        if not path.name.startswith("tasks20_5shot_")
        for row in _load(path)
    ]
    rank = {name: number for number, name in enumerate(TASK_ORDER)}
    rows.sort(key=lambda row: rank.get(row["task"], len(rank)))
    if not rows:
        return "(no tasks20_*.json)"
    policies = _policies(rows)
    lines = [
        "| task | n | " + " | ".join(policies) + " |",
        "|---|---|" + "---|" * len(policies),
    ]
    for task in dict.fromkeys(row["task"] for row in rows):
        cells, n = [], None
        for policy in policies:
            match = [r for r in rows if r["task"] == task and r["policy"] == policy]
            if not match:
                cells.append("–")
                continue
            r = match[0]
            n = r["n"]
            cells.append(f"{r['acc']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]")
        lines.append(f"| {task} | {n} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("acc_norm (length-normalised), same runs:\n")
    lines.append("| task | " + " | ".join(policies) + " | mean prompt (tokens) | mean budget (tokens) |")
    lines.append("|---|" + "---|" * (len(policies) + 2))
    for task in dict.fromkeys(row["task"] for row in rows):
        cells = []
        for policy in policies:
            match = [r for r in rows if r["task"] == task and r["policy"] == policy]
            cells.append(f"{match[0]['acc_norm']:.2f}" if match and "acc_norm" in match[0] else "–")
        budget = [r["budget_tokens_mean"] for r in rows if r["task"] == task and r["policy"] == "h2o"]
        prompt = [r["budget_tokens_mean"] for r in rows if r["task"] == task and r["policy"] == "full"]
        lines.append(
            f"| {task} | "
            + " | ".join(cells)
            + f" | {prompt[0] if prompt else '–'} | {budget[0] if budget else '–'} |"
        )
    return "\n".join(lines)


def long_table(path: Path) -> str:
    rows = _load(path)
    if not rows:
        return f"({path.name} missing)"
    lines = [
        "| task | cell | policy | n | hit (contains answer) [95% CI] | exact match |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cell = f"{r['length']} tok, {r['depth']}" if "length" in r else ""
        metric = f"{r['acc']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]" if "acc" in r else "–"
        lines.append(f"| {r['task']} | {cell} | {r['policy']} | {r['n']} | {metric} | {r.get('em', '–')} |")
    return "\n".join(lines)


def xsum_table(path: Path) -> str:
    rows = _load(path)
    if not rows:
        return f"({path.name} missing)"
    lines = ["| policy | n | mean budget (tok) | ROUGE-1 | ROUGE-2 | ROUGE-L |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['n']} | {r['budget_tokens_mean']} | {r['rouge1']:.2f} | {r['rouge2']:.2f} | {r['rougeL']:.2f} |"
        )
    return "\n".join(lines)


def figure(books: dict[str, list[dict]], path: Path) -> Path | None:
    if not books:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(books), figsize=(4 * len(books), 3.4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], books.items(), strict=False):
        for policy in _policies(rows):
            points = sorted((r["budget"], r["ppl"]) for r in rows if r["policy"] == policy)
            if policy == "full":
                ax.axhline(points[0][1], color="black", linestyle="--", label="full")
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        ax.set_xscale("log")
        budgets = sorted({r["budget"] for r in rows if r["policy"] != "full"})
        ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("budget (fraction of tokens read)")
        ax.set_ylabel("perplexity")
        ax.set_title(f"{name.split('_pg')[0]} ({rows[0]['tokens']} tok)", fontsize=10)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


STREAM_VARIANTS = {  # file suffix of docs/results/variants_BOOK_SUFFIX.json -> row label
    "base": None,  # h2o (paper), sink, local: as the rows name them
    "local": None,
    "decay": "h2o, --score-decay {gamma}",
    "sinks4": "h2o, --h2o-sinks 4",
    "split25": "h2o, --score-decay {gamma} --heavy-ratio 0.25",
}


def variant_tables(out: Path) -> str:
    """h2o's variants on long streams, reduced scale: per book, PPL at 410 and 819 tokens for h2o (paper), its variants, sink,
    local (files `variants_BOOK_VARIANT.json`), and the γ sweep (`variants_gamma_BOOK.json`)."""
    books: dict[str, dict[str, dict[int, float]]] = {}
    tokens: dict[str, int] = {}
    for path in sorted(out.glob("variants_*_pg*_*.json")):
        book, _, variant = path.stem.removeprefix("variants_").rpartition("_")
        rows = _load(path)
        table = books.setdefault(book, {})
        for row in rows:
            if STREAM_VARIANTS[variant] is None:
                label = "h2o (paper)" if row["policy"] == "h2o" else row["policy"]
            else:
                label = STREAM_VARIANTS[variant].format(gamma=row.get("score_decay"))
            table.setdefault(label, {})[row["budget_tokens"]] = row["ppl"]
            tokens[book] = row["tokens"]
    lines = []
    order = ("h2o (paper)", "h2o, --score-decay", "h2o, --h2o-sinks", "sink", "local")
    for book, table in books.items():
        budgets = sorted({budget for cells in table.values() for budget in cells})
        lines.append(f"**{book}** ({tokens[book]:,} tokens, chunk 256)\n")
        lines.append("| policy | " + " | ".join(f"{budget} tok" for budget in budgets) + " |")
        lines.append("|---" * (len(budgets) + 1) + "|")
        labels = sorted(table, key=lambda label: next(n for n, p in enumerate(order) if label.startswith(p)))
        for label in labels:
            cells = []
            for budget in budgets:
                value = table[label].get(budget)
                best = min(cells_[budget] for cells_ in table.values() if budget in cells_)
                cell = "–" if value is None else f"{value:.3f}"
                cells.append(f"**{cell}**" if value == best else cell)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    sweep = [row for path in sorted(out.glob("variants_gamma_*.json")) for row in _load(path)]
    if sweep:
        lines.append(
            "| --score-decay γ | " + " | ".join(f"{r['budget_tokens']} tok" for r in sweep[:1]) + " |"
        )
        lines.append("|---|---|")
        for row in sorted(sweep, key=lambda row: row["score_decay"]):
            lines.append(f"| {row['score_decay']:g} | {row['ppl']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results", type=Path)
    parser.add_argument("--figs", default="docs/figs", type=Path)
    args = parser.parse_args()
    ppl, books = ppl_tables(args.out)
    print("## Perplexity vs budget\n\n" + ppl)
    print("## score-norm\n\n" + norm_table(args.out, books) + "\n")
    print("## Tasks at 20%\n\n" + task_table(args.out) + "\n")
    print("## Tasks at 20%, 5-shot, paired\n\n" + paired_task_tables(args.out) + "\n")
    print("## xsum\n\n" + xsum_table(args.out / "xsum.json") + "\n")
    for name in ("needle", "hotpotqa", "kv_retrieval"):
        print(f"## {name}\n\n" + long_table(args.out / f"{name}.json") + "\n")
    print("## h2o variants on long streams (reduced scale)\n\n" + variant_tables(args.out) + "\n")
    made = figure(books, args.figs / "budget_ppl.png")
    if made:
        print(f"figure: {made}")


if __name__ == "__main__":
    main()
