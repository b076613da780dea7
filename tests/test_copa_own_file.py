"""`h2o eval copa --data FILE --shots N` on a COPA file of one's own (ids that say nothing of SuperGLUE's split):
every item scored, each one's shots drawn from the file's other items, as `copa_all` does (no model: lm-eval
scores through a stand-in that records what it is asked)."""

from __future__ import annotations

import re

import pytest
from conftest import FIXTURES
from lm_eval.api.model import LM

from h2o_cli.config import CacheSettings
from h2o_cli.eval.data import copa_task
from h2o_cli.eval.runner import run_harness
from h2o_cli.eval.tasks.utils import copa_doc_to_target, copa_doc_to_text


class RecordingLM(LM):
    """Answers every log-likelihood request with minus the continuation's length and keeps the contexts."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: list[str] = []

    def configure(self, spec) -> None:
        pass

    def gathered_budget_tokens(self) -> list[int]:
        return []

    def loglikelihood(self, requests):
        self.contexts += [request.args[0] for request in requests]
        return [(-float(len(request.args[1])), False) for request in requests]

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError

    def generate_until(self, requests):
        raise NotImplementedError


def own_copa_file(path, ids: list[int]) -> list[dict]:
    """The shipped COPA items renumbered `ids`, written to `path` in COPA's XML; returns them as docs."""
    text = (FIXTURES / "tasks" / "copa.xml").read_text(encoding="utf-8")
    items = re.findall(r"<item .*?</item>", text, flags=re.S)[: len(ids)]
    items = [
        re.sub(r'id="\d+"', f'id="{number}"', item, count=1) for item, number in zip(items, ids, strict=True)
    ]
    path.write_text('<?xml version="1.0" encoding="UTF-8"?>\n<copa-corpus version="1.0">\n' + "\n".join(items)
                    + "\n</copa-corpus>\n", encoding="utf-8")  # fmt: skip
    from h2o_cli.eval.data import load_copa

    splits = load_copa(path)
    return splits["train"] + splits["validation"]


@pytest.mark.parametrize("ids", [list(range(1, 9)), list(range(501, 509))], ids=["low-ids", "high-ids"])
def test_own_copa_file_scores_every_item_with_shots_from_the_others(tmp_path, ids):
    """Eight items all below id 400 (no validation split) or all above (no train split): each is scored once
    with 5 shots, none of them itself."""
    path = tmp_path / "my_copa.xml"
    docs = own_copa_file(path, ids)
    assert copa_task(path) == "copa_all"
    lm = RecordingLM()
    row = run_harness(lm, "copa", CacheSettings(budget=0.5), None, 5, 1234, str(path))
    assert row["task"] == "copa" and row["n"] == len(docs) == 8
    assert len(lm.contexts) == 2 * len(docs)  # two alternatives per item
    for doc in docs:
        asked = [context for context in lm.contexts if context.endswith(copa_doc_to_text(doc))]
        assert len(asked) == 2
        for context in asked:
            assert context.count("\n\n") == 5  # five shots, each closed by lm-eval's fewshot delimiter
            assert f"{copa_doc_to_text(doc)} {copa_doc_to_target(doc)}" not in context


def test_copa_dev_file_keeps_superglue_split():
    """The shipped cut of the COPA dev set holds ids on both sides of 400: scored as `copa` (validation)."""
    assert copa_task(FIXTURES / "tasks" / "copa.xml") == "copa"
