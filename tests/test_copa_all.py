"""The h2o_copa_all task: every labelled COPA item scored, each item's shots drawn from the others (no model)."""

from __future__ import annotations

import pytest
from conftest import FIXTURES, SHARED_DATA


def copa_all_task(data_path=None):
    from lm_eval.tasks import TaskManager, get_task_dict

    from h2o_cli.eval.runner import TASKS_DIR

    metadata = {"data_path": str(data_path)} if data_path else None
    manager = TaskManager(include_path=[str(TASKS_DIR)], include_defaults=False, metadata=metadata)
    return get_task_dict(["h2o_copa_all"], manager)["h2o_copa_all"]


def shots_of_every_doc(task, shots: int = 5) -> list[tuple[dict, list[dict], str]]:
    """(doc, its shots, its prompt) for every document, through lm-eval's own `fewshot_context`."""
    task.set_fewshot_seed(seed=1234)  # what `h2o eval` passes (--seed)
    sample, drawn = task.sampler.sample, []

    def recording(*args, **kwargs):
        drawn.append(sample(*args, **kwargs))
        return drawn[-1]

    task.sampler.sample = recording
    out = []
    for doc in task.eval_docs:
        prompt = task.fewshot_context(doc=doc, num_fewshot=shots)
        out.append((doc, drawn.pop(), prompt))
    return out


def assert_no_doc_among_its_shots(task, shots: int = 5) -> None:
    from h2o_cli.eval.tasks.utils import copa_doc_to_target, copa_doc_to_text

    for doc, drawn, prompt in shots_of_every_doc(task, shots):
        assert len(drawn) == shots and len({shot["idx"] for shot in drawn}) == shots
        assert doc["idx"] not in {shot["idx"] for shot in drawn}
        # The prompt itself: each shot is text + " " + answer, the question last without its answer.
        answered = f"{copa_doc_to_text(doc)} {copa_doc_to_target(doc)}"
        assert prompt.endswith(copa_doc_to_text(doc)) and answered not in prompt
        assert all(f"{copa_doc_to_text(shot)} {copa_doc_to_target(shot)}" in prompt for shot in drawn)


def gold_labels(path) -> dict[int, int]:
    """COPA's separate answer file: "id 1 0" when alternative 1 is right (label 0), "id 0 1" for 2 (label 1)."""
    return {int(i): (0 if a1 == "1" else 1) for i, a1, _ in map(str.split, path.read_text().splitlines())}


def test_fixture_items_all_scored_with_their_gold_labels_none_among_its_own_shots():
    """8 items, 5 shots: the sampler draws 6 of 8, so without the exclusion most items would meet themselves.
    Each item's label is the answer file's (tests/data/tasks/copa-gold.dev, cut from COPA's gold.dev)."""
    task = copa_all_task(FIXTURES / "tasks" / "copa.xml")
    docs = list(task.eval_docs)
    assert [doc["idx"] for doc in docs] == [1, 2, 3, 4, 401, 402, 403, 404]
    assert {doc["idx"]: doc["label"] for doc in docs} == gold_labels(FIXTURES / "tasks" / "copa-gold.dev")
    assert_no_doc_among_its_shots(task)


@pytest.mark.data
def test_all_500_items_and_shots_exclude_the_item():
    task = copa_all_task()
    docs = list(task.eval_docs)
    assert [doc["idx"] for doc in docs] == list(range(1, 501))
    assert docs[400]["premise"] == "The man turned on the faucet."  # SuperGLUE validation idx 0
    assert_no_doc_among_its_shots(task)


@pytest.mark.data
def test_all_500_items_carry_the_gold_labels():
    gold = SHARED_DATA / "copa" / "gold.dev"
    if not gold.is_file():
        pytest.skip(f"COPA's answer file {gold} is not in the data folder")
    answers = gold_labels(gold)
    assert len(answers) == 500
    assert {doc["idx"]: doc["label"] for doc in copa_all_task().eval_docs} == answers
