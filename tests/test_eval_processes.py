"""`h2o eval --processes N`: the examples split over N processes, each with its own model and cache, give the
rows of one process (metrics, budgets, per-example outcomes, paired differences)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import FIXTURES
from test_eval_cost import _env, tiny_copa_model

pytest.importorskip("lm_eval")


@pytest.mark.heavy  # fresh interpreters: the command, and the processes it spawns
@pytest.mark.model  # the embedded model's tokenizer
def test_two_processes_give_the_rows_of_one(smollm, tmp_path):
    """3 COPA examples over 2 processes: an uneven split (lm-eval pads the shorter share)."""
    folder, _ = tiny_copa_model(smollm[1], tmp_path)
    rows = {}
    for processes in (1, 2):
        result = subprocess.run(
            [sys.executable, "-m", "h2o_cli", "eval", "copa", "--data", str(FIXTURES / "tasks" / "copa.xml"),
             "--model", str(folder), "--dtype", "float32", "--policies", "full,h2o,local", "--budget", "0.5",
             "--limit", "3", "--threads", "1", "--json", "--processes", str(processes)],
            capture_output=True, env=_env(), timeout=600, cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr.decode()[-2000:]
        rows[processes] = json.loads(result.stdout)
    assert [row["policy"] for row in rows[1]] == ["full", "h2o", "local"]
    assert all(row["n"] == 3 and len(row["correct"]) == 3 for row in rows[1])
    assert "delta_vs_full" in rows[1][1]
    assert rows[2] == rows[1]


def test_long_tasks_run_in_one_process(monkeypatch, capsys):
    """The long-context tasks do not go through lm-eval: --processes refuses them before any model loads."""
    from h2o_cli.cli.app import main

    monkeypatch.setattr("h2o_cli.cli.eval.load", lambda *args, **kwargs: pytest.fail("loaded a model"))
    # `--data-dir` sets $H2O_DATA for lm-eval's loaders: recorded first, so the tests after see it undone.
    monkeypatch.setenv("H2O_DATA", os.environ.get("H2O_DATA", ""))
    monkeypatch.setattr(
        sys, "argv", ["h2o", "eval", "needle", "--processes", "2", "--data-dir", str(FIXTURES)]
    )
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 2
    assert "--processes" in capsys.readouterr().err
