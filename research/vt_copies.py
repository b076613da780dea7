"""Does a RULER `vt` answer name the document's chain, or copy the prompt's worked example?

RULER's `vt` prompt opens with a worked example: a short chain and the task's question, answered ("... they
are: HAW UYU CSD LVH XYT"). For each cell (lm-eval `--log_samples` output folders, full samples with their
prompts), this counts the answers that name at least one of the document's own variables (the task's
targets) and those that name at least one of the example's (the words after the example's "they are:"). A
document answered twice in a cell counts once, its latest answer, as in research/ruler_table.py.

    python -m research.vt_copies r05=/work/runs/r09/r05_vt_32k/out r075=A/out,B/out r09=/work/runs/r09/r09_vt_32k/out
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from research.ruler_table import samples

NAME = re.compile(r"\b[A-Z]{3,5}\b")


def counts(sample: dict) -> tuple[bool, bool]:
    """(names one of the chain's variables, names one of the worked example's) for one lm-eval sample."""
    prompt = sample["arguments"]["gen_args_0"]["arg_0"]
    example = prompt.split("Answer:", 1)[1].split("Memorize", 1)[0].split("they are:", 1)[1]
    answer = set(NAME.findall(sample["resps"][0][0]))
    targets = set(re.findall(r"[A-Z]{5}", str(sample["target"])))
    return bool(answer & targets), bool(answer & set(NAME.findall(example)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "cells", nargs="+", help="NAME=FOLDER[,FOLDER...]: lm-eval output folders of one cell"
    )
    args = parser.parse_args()
    print("| cell | answers | name the chain's variables | name the example's |")
    print("|---|---|---|---|")
    for cell in args.cells:
        name, folders = cell.split("=", 1)
        answered = samples([Path(folder) for folder in folders.split(",")]).get("ruler_vt", {})
        rows = [counts(sample) for sample in answered.values()]
        print(f"| {name} | {len(rows)} | {sum(c for c, _ in rows)} | {sum(e for _, e in rows)} |")


if __name__ == "__main__":
    main()
