"""`h2o eval TASK --data FILE` for every task, on small files in each task's format (tests/data/tasks/)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import FIXTURES

TASK_FILES = FIXTURES / "tasks"
# task -> (file in its format, examples in that file that the task scores)
CASES = {
    "copa": ("copa.xml", 4),  # validation = ids > 400
    "copa_all": ("copa.xml", 8),  # every item
    "piqa": ("piqa/valid.jsonl", 6),
    "openbookqa": ("openbookqa.jsonl", 6),
    "winogrande": ("winogrande.jsonl", 6),
    "rte": ("rte.tsv", 6),
    "mathqa": ("mathqa.jsonl", 6),
    "xsum": ("xsum.jsonl", 1),
    "hotpotqa": ("hotpotqa.json", 2),
    "kv-retrieval": ("kv-retrieval.jsonl.gz", 2),
}


@pytest.fixture
def loaded_eval(smollm, monkeypatch):
    monkeypatch.setattr("h2o_cli.cli.eval.load", lambda *args, **kwargs: smollm)
    return smollm


def run_eval(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    from h2o_cli.cli.app import main

    monkeypatch.setattr(sys, "argv", ["h2o", "eval", *args])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


@pytest.mark.parametrize("task", list(CASES))
def test_data_option_scores_the_given_file(loaded_eval, monkeypatch, capsys, task):
    """Regression: the lm-eval tasks ended in a traceback (`load_dataset(path=None)`). Every example of the
    given file is scored, and only those: n equals the file's count, not the shared copy's."""
    name, count = CASES[task]
    code, out, err = run_eval(
        monkeypatch,
        capsys,
        task,
        "--data",
        str(TASK_FILES / name),
        "--policies",
        "full",
        "--json",
        "--threads",
        "1",
    )
    assert code in (0, None), err
    (row,) = json.loads(out)
    assert row["task"] == task and row["n"] == count and 0 <= row.get("acc", row.get("rouge1", 0)) <= 100


def test_needle_data_folder(loaded_eval, monkeypatch, capsys):
    code, out, err = run_eval(
        monkeypatch, capsys, "needle", "--data", str(TASK_FILES / "essays"), "--policies", "full", "--limit", "1",
        "--json", "--threads", "1",
    )  # fmt: skip
    assert code in (0, None), err
    (row,) = json.loads(out)
    assert row["n"] == 1 and row["length"] == 1000


@pytest.mark.parametrize(
    ("task", "file", "code", "words"),
    [
        ("piqa", "copa.xml", 1, "not a piqa file"),
        ("copa", "rte.tsv", 1, "not a copa file"),
        ("rte", "mathqa.jsonl", 1, "not a rte file"),
        ("hotpotqa", "openbookqa.jsonl", 1, "not a hotpotqa file"),
        ("kv-retrieval", "copa.xml", 1, "not a kv-retrieval file"),
        ("needle", "copa.xml", 1, "no essays"),
        ("copa", "no-such-file.xml", 1, "does not exist"),
        ("lambada_openai", "copa.xml", 2, "built-in tasks"),
    ],
)
def test_wrong_data_file_is_one_line(loaded_eval, monkeypatch, capsys, task, file, code, words):
    got, out, err = run_eval(
        monkeypatch, capsys, task, "--data", str(TASK_FILES / file), "--policies", "full"
    )
    lines = err.strip().splitlines()
    assert got == code and out == "" and "Traceback" not in err
    assert words in lines[-1] and not any("Traceback" in line for line in lines)


@pytest.mark.model  # loads the embedded model in the subprocess (the hook only sees the `smollm` fixture)
def test_lm_eval_command_line_reaches_the_h2o_model(tmp_path):
    """Regression: `lm_eval --model h2o` (lm-eval's own CLI) could not find the model. `h2o lm-eval` hands
    every argument to that CLI with the model registered; run as a user would, on a local task."""
    import os
    import subprocess

    from conftest import REPO

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels"), os.environ.get("PYTHONPATH", "")]),
        "OMP_WAIT_POLICY": "PASSIVE",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    metadata = json.dumps({"data_path": str(TASK_FILES / "copa.xml")})
    result = subprocess.run(
        [sys.executable, "-c", "from h2o_cli.cli.app import main; main()", "lm-eval", "--model", "h2o",
         "--model_args", "model=smollm2-135m,budget=0.5,policy=h2o,threads=1", "--tasks", "h2o_copa",
         "--limit", "3", "--metadata", metadata, "--output_path", str(tmp_path / "out")],
        capture_output=True, env=env, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    table = result.stdout.decode()
    assert "h2o (" in table and "|h2o_copa|" in table and "acc" in table
    (saved,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(saved.read_text())
    assert results["config"]["model"] == "h2o" and results["n-samples"]["h2o_copa"]["effective"] == 3
