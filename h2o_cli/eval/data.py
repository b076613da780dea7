"""Loaders for the real task files in the shared data folder (each folder documents itself in SOURCE.txt).

Each loader returns plain dicts in the field names lm-eval's own task of the same name uses, so the task
YAMLs in `h2o_cli/eval/tasks/` can copy lm-eval's prompts. `path` overrides the default file; the default files
lie under the data folder, `$H2O_DATA` (lm-eval calls the loaders itself, so the folder travels in the environment).
"""

from __future__ import annotations

import ast
import csv
import gzip
import json
import os
import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from h2o_cli.errors import H2OError, InputError, UsageError

DATA_ENV = "H2O_DATA"
NO_DATA = f"pass --data-dir DIR or set ${DATA_ENV} to the folder that holds the task files"


def data_dir(root: str | os.PathLike | None = None) -> Path:
    """The data folder: `root` (a `--data-dir` option), else `$H2O_DATA`; an error naming both otherwise."""
    folder = root or os.environ.get(DATA_ENV)
    if not folder:
        raise H2OError(f"no data folder given: {NO_DATA}")
    if not Path(folder).is_dir():
        raise H2OError(f"data folder {folder} not found: {NO_DATA}")
    return Path(folder)


def _file(path: str | os.PathLike | None, default: str) -> Path:
    if path:
        if not Path(path).is_file():
            raise H2OError(f"data file {path} not found")
        return Path(path)
    file = data_dir() / default
    if not file.is_file():
        raise H2OError(f"data file {file} not found: {NO_DATA}")
    return file


def read_jsonl(file: Path) -> list[dict]:
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_copa(path=None) -> dict[str, list[dict]]:
    """COPA dev XML (500 items): SuperGLUE train = ids 1-400, validation = ids 401-500 (SOURCE.txt)."""
    root = ElementTree.parse(_file(path, "copa/copa-dev.xml")).getroot()
    splits: dict[str, list[dict]] = {"train": [], "validation": []}
    for item in root.iter("item"):
        doc = {
            "idx": int(item.get("id")),
            "premise": item.findtext("p"),
            "choice1": item.findtext("a1"),
            "choice2": item.findtext("a2"),
            "question": item.get("asks-for"),
            "label": int(item.get("most-plausible-alternative")) - 1,
        }
        splits["validation" if doc["idx"] > 400 else "train"].append(doc)
    return splits


def copa_task(path) -> str:
    """The task a COPA file is scored as: `copa` (the validation split, shots from train) when it holds
    SuperGLUE's split (items on both sides of id 400, as the COPA dev set), else `copa_all`: every item
    scored, its shots drawn from the file's other items (a file of one's own, whose ids say nothing of a
    split, so either split may be empty)."""
    splits = load_copa(path)
    return "copa" if splits["train"] and splits["validation"] else "copa_all"


def load_piqa(path=None) -> list[dict]:
    """PIQA validation (1838): valid.jsonl with labels from valid-labels.lst beside it."""
    file = _file(path, "piqa/valid.jsonl")
    labels = (file.parent / "valid-labels.lst").read_text().split()
    docs = read_jsonl(file)
    if len(labels) != len(docs):
        raise H2OError(f"{file}: {len(docs)} questions but {len(labels)} labels")
    return [{**doc, "label": int(label)} for doc, label in zip(docs, labels, strict=False)]


def load_openbookqa(path=None) -> list[dict]:
    """OpenBookQA main test (500), MosaicML form {query, choices, gold}."""
    return read_jsonl(_file(path, "llmfoundry_mc/openbook_qa.jsonl"))


def load_winogrande(path=None) -> list[dict]:
    """WinoGrande dev (1267), MosaicML partial-scoring form {context_options, continuation, gold}."""
    return read_jsonl(_file(path, "llmfoundry_mc/winogrande.jsonl"))


def load_rte(path=None) -> list[dict]:
    """GLUE RTE validation (277): dev.tsv with sentence1, sentence2, label (0 = entailment), idx."""
    with open(_file(path, "rte/dev.tsv"), encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [{**row, "label": int(row["label"]), "idx": int(row["idx"])} for row in rows]


def mathqa_options(options: str) -> list[str]:
    """'a ) 12 , b ) 16 , ...' -> ['12', '16', ...] with lm-eval mathqa's own regex (list-string quirk joined first)."""
    if options.lstrip().startswith("["):
        options = " , ".join(str(part).strip() for part in ast.literal_eval(options))
    return [choice[4:].rstrip(" ,") for choice in re.findall(r"[abcd] \) .*?, |e \) .*?$", options)]


def load_mathqa(path=None) -> list[dict]:
    """MathQA test subset (1000) with lm-eval's fields: Problem, options, correct, choices (parsed)."""
    docs = read_jsonl(_file(path, "mathqa/test_1000.jsonl"))
    return [
        {
            "Problem": doc["problem"],
            "options": doc["options"],
            "correct": doc["correct"],
            "choices": mathqa_options(doc["options"]),
        }
        for doc in docs
    ]


def load_xsum(path=None) -> list[dict]:
    """The H2O authors' XSUM 0-shot prompts (1000): {article (full prompt), summary_gt, stop, max_tokens}."""
    return read_jsonl(_file(path, "xsum_h2o/xsum_0shot.jsonl"))


def load_hotpotqa(path=None) -> list[dict]:
    """HotpotQA distractor dev, first 103 questions: {question, answer, context: [[title, sentences]], ...}."""
    with open(
        _file(path, "hotpotqa_distractor/hotpot_dev_distractor_v1_first103.json"), encoding="utf-8"
    ) as f:
        return json.load(f)


def load_kv_retrieval(path=None) -> list[dict]:
    """Lost-in-the-middle KV retrieval, 75 keys (500): {ordered_kv_records, key, value}."""
    return read_jsonl(_file(path, "lost_in_the_middle/kv-retrieval-75_keys.jsonl.gz"))


def load_essays(path=None) -> str:
    """Paul Graham essays concatenated in name order (the needle-in-a-haystack haystack)."""
    folder = Path(path) if path else data_dir() / "paul_graham_essays" / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise H2OError(f"no essays (*.txt) in {folder}; point --data at the PaulGrahamEssays folder")
    return "\n".join(file.read_text(encoding="utf-8") for file in files)


# Each built-in task's loader and the fields its prompts read (lm-eval's names), for checking a `--data` file.
LOADERS = {
    "copa": (load_copa, ("premise", "choice1", "choice2", "question", "label")),
    "copa_all": (load_copa, ("premise", "choice1", "choice2", "question", "label")),
    "piqa": (load_piqa, ("goal", "sol1", "sol2", "label")),
    "openbookqa": (load_openbookqa, ("query", "choices", "gold")),
    "winogrande": (load_winogrande, ("context_options", "continuation", "gold")),
    "rte": (load_rte, ("sentence1", "sentence2", "label")),
    "mathqa": (load_mathqa, ("Problem", "choices", "correct")),
    "xsum": (load_xsum, ("article", "summary_gt")),
    "hotpotqa": (load_hotpotqa, ("question", "answer", "context")),
    "kv-retrieval": (load_kv_retrieval, ("ordered_kv_records", "key", "value")),
    "needle": (load_essays, ()),
}


def check_data(task: str, path: str) -> None:
    """Load `--data` for `task` once and raise a one-line `InputError` unless it is that task's format."""
    if task not in LOADERS:
        raise UsageError(f"--data works with the built-in tasks ({', '.join(LOADERS)}), not {task!r}")
    loader, fields = LOADERS[task]
    if not Path(path).exists():
        raise InputError(f"--data {path} does not exist")
    try:
        loaded = loader(path)
        rows = [row for split in loaded.values() for row in split] if isinstance(loaded, dict) else loaded
        missing = [name for name in fields for row in rows[:1] if name not in row]
    except H2OError:
        raise
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        SyntaxError,
        csv.Error,
    ) as error:
        detail = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise InputError(f"--data {path} is not a {task} file in the expected format ({detail})") from None
    if not rows:
        raise InputError(f"--data {path} holds no {task} examples")
    if missing:
        raise InputError(f"--data {path} is not a {task} file: its records lack {', '.join(missing)}")
