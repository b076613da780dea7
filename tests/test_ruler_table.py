"""research/ruler_table.py: scores read from lm-eval samples files, documents paired across cells, and samples
kept without their text still read as the same scores."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ruler_table():
    sys.path.insert(0, str(ROOT))
    try:
        yield importlib.import_module("research.ruler_table")
    finally:
        sys.path.remove(str(ROOT))


def write_cell(folder: Path, task: str, scores: dict[int, float], length: int = 32768) -> None:
    """An lm-eval samples file: each row's score under its length's key, the other length's -1."""
    folder.mkdir(parents=True)
    rows = [
        {
            "doc_id": doc, "doc": {"input": "haystack " * 50, "max_length": length, "outputs": ["1"]},
            "arguments": {"gen_args_0": {"arg_0": "haystack " * 50}}, "resps": [["1"]],
            str(length): score, "4096" if length != 4096 else "32768": -1,
        }
        for doc, score in scores.items()
    ]  # fmt: skip
    (folder / f"samples_{task}_2026-12-06T20-16-10.484023.jsonl").write_text(
        "\n".join(map(json.dumps, rows)) + "\n"
    )


def test_paired_counts_the_documents_each_cell_scored_above_the_other(ruler_table, tmp_path):
    write_cell(tmp_path / "a", "niah_multivalue", {20: 0.75, 21: 0.25, 22: 0.5, 23: 0.0})
    write_cell(tmp_path / "b", "niah_multivalue", {20: 0.25, 21: 0.25, 22: 0.75, 24: 1.0})
    cells = {name: ruler_table.scores([tmp_path / name]) for name in ("a", "b")}
    line = ruler_table.paired(cells, "a", "b")
    # documents 20-22 in both: a above b on 20, below on 22, equal on 21; means over those three
    assert line == ("niah_multivalue: a 0.500 vs b 0.417 on the same 3 documents; 1 up, 1 down, 1 equal")


def test_kept_samples_leave_the_text_out_and_read_as_the_same_scores(ruler_table, tmp_path):
    write_cell(tmp_path / "run" / "out", "niah_single_1", {0: 1.0, 1: 0.0})
    assert ruler_table.keep([tmp_path / "run"], tmp_path / "kept") == 1
    (kept,) = (tmp_path / "kept").iterdir()
    rows = [json.loads(line) for line in kept.read_text().splitlines()]
    assert all("arguments" not in row and "input" not in row["doc"] for row in rows)
    assert rows[0]["doc"]["max_length"] == 32768 and rows[0]["resps"] == [["1"]]
    same = ruler_table.scores([tmp_path / "run"]), ruler_table.scores([tmp_path / "kept"])
    assert same[0] == same[1] == {"niah_single_1": {0: 1.0, 1: 0.0}}
