"""`h2o lm-eval`'s start-up: lm-eval's own task folder (~14,000 YAML files, ~10 s to index) is indexed only
when a task asked for may live there; the h2o_* tasks are found in the project's folder alone."""

from __future__ import annotations

import sys

import pytest

from h2o_cli.eval.runner import TASKS_DIR


def run_lm_eval(monkeypatch, *args: str) -> dict:
    """`h2o lm-eval ARGS` with lm-eval's own CLI replaced by a probe: what it would have indexed."""
    import lm_eval.__main__
    import lm_eval.tasks

    from h2o_cli.cli.app import main

    seen: dict = {}

    def probe() -> None:
        manager = lm_eval.tasks.TaskManager
        seen["own_class"] = manager is own
        seen["argv"] = list(sys.argv)
        if not seen["own_class"]:  # indexing the project's folder alone is quick
            seen["tasks"] = set(manager(include_path=[str(TASKS_DIR)]).all_tasks)

    own = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", probe)
    monkeypatch.setattr(sys, "argv", ["h2o", "lm-eval", *args])
    with pytest.raises(SystemExit) as done:
        main()
    assert (done.value.code or 0) == 0
    assert lm_eval.tasks.TaskManager is own  # restored after the command
    return seen


def test_h2o_tasks_alone_skip_lm_evals_own_task_folder(monkeypatch):
    seen = run_lm_eval(monkeypatch, "--model", "h2o", "--tasks", "h2o_copa,h2o_piqa", "--limit", "2")
    assert not seen["own_class"]
    assert {path.stem for path in TASKS_DIR.glob("*.yaml")} <= seen["tasks"]
    assert "arc_easy" not in seen["tasks"] and "hellaswag" not in seen["tasks"]
    assert seen["argv"][-4:] == ["--include_path", str(TASKS_DIR), "--device", "auto"]


@pytest.mark.parametrize(
    "tasks",
    ["h2o_copa,arc_easy", "hellaswag", "/some/folder/task.yaml"],
    ids=["mixed", "lm-eval's", "a file"],
)
def test_any_other_task_keeps_lm_evals_own_task_folder(monkeypatch, tasks):
    seen = run_lm_eval(monkeypatch, "--model", "hf", "--tasks", tasks)
    assert seen["own_class"]
