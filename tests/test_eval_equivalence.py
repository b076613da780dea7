"""`full` through the H2O cache equals lm-eval's own hf model and a plain transformers log-likelihood."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TASKS = os.path.join(os.path.dirname(__file__), "..", "h2o_cli", "eval", "tasks")
LIMIT = 10


@pytest.fixture(scope="module")
def reference(smollm):
    """The same weights with plain sdpa attention and transformers' own cache."""
    from transformers import AutoModelForCausalLM

    from h2o_cli.models import local_folder, resolve

    return AutoModelForCausalLM.from_pretrained(
        local_folder(resolve("smollm2-135m")), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def _copa(lm):
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["h2o_copa"],
        limit=LIMIT,
        task_manager=TaskManager(include_path=TASKS),
        log_samples=True,
        verbosity="ERROR",
    )
    scores = [float(resp[0][0]) for sample in out["samples"]["h2o_copa"] for resp in sample["resps"]]
    return out["results"]["h2o_copa"], scores


def test_full_matches_lm_eval_hf_and_plain_transformers(smollm, reference):
    from lm_eval.models.huggingface import HFLM

    from h2o_cli.eval.data import load_copa
    from h2o_cli.eval.lm_eval_model import H2OLM
    from h2o_cli.eval.tasks.utils import copa_doc_to_choice, copa_doc_to_text

    ours, our_scores = _copa(H2OLM(model=smollm, policy="full"))
    hf, hf_scores = _copa(HFLM(pretrained=reference, tokenizer=smollm[1], batch_size=1))
    assert ours["acc,none"] == hf["acc,none"]
    assert ours["acc_norm,none"] == hf["acc_norm,none"]
    assert our_scores == pytest.approx(hf_scores, abs=2e-3)

    # Plain transformers, no cache code: log p(choice | premise) from one forward over context + choice.
    tokenizer = smollm[1]
    correct = 0
    for doc in load_copa()["validation"][:LIMIT]:
        context = copa_doc_to_text(doc)
        totals = []
        for choice in copa_doc_to_choice(doc):
            context_ids = tokenizer(context)["input_ids"]
            whole = tokenizer(context + choice)["input_ids"]
            with torch.no_grad():
                logprobs = torch.log_softmax(reference(torch.tensor([whole])).logits[0].float(), -1)
            targets = torch.tensor(whole[len(context_ids) :])
            totals.append(float(logprobs[len(context_ids) - 1 : -1].gather(1, targets[:, None]).sum()))
        correct += int(max(range(2), key=totals.__getitem__) == doc["label"])
    assert ours["acc,none"] == pytest.approx(correct / LIMIT)
