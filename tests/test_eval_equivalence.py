"""`full` through the H2O cache equals lm-eval's own hf model and a plain transformers log-likelihood."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

pytestmark = pytest.mark.data  # COPA from the data folder

TASKS = os.path.join(os.path.dirname(__file__), "..", "h2o_cli", "eval", "tasks")


@pytest.fixture(scope="module")
def reference(smollm):
    """The same weights with plain sdpa attention and transformers' own cache."""
    from transformers import AutoModelForCausalLM

    from h2o_cli.models import local_folder, resolve

    return AutoModelForCausalLM.from_pretrained(
        local_folder(resolve("smollm2-135m")), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def _copa(lm, limit):
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["h2o_copa"],
        limit=limit,
        task_manager=TaskManager(include_path=TASKS),
        log_samples=True,
        verbosity="ERROR",
    )
    samples = out["samples"]["h2o_copa"]
    scores = [float(resp[0][0]) for sample in samples for resp in sample["resps"]]
    return out["results"]["h2o_copa"], scores, samples


@pytest.mark.parametrize("limit", [3, pytest.param(10, marks=pytest.mark.slow)])
def test_full_matches_lm_eval_hf_and_plain_transformers(smollm, reference, limit):
    """3 COPA examples in the default suite (fast); 10 in the slow one."""
    from lm_eval.models.huggingface import HFLM

    from h2o_cli.eval.lm_eval_model import H2OLM

    ours, our_scores, samples = _copa(H2OLM(model=smollm, policy="full"), limit)
    hf, hf_scores, _ = _copa(HFLM(pretrained=reference, tokenizer=smollm[1], batch_size=1), limit)
    assert ours["acc,none"] == hf["acc,none"]
    assert ours["acc_norm,none"] == hf["acc_norm,none"]
    assert our_scores == pytest.approx(hf_scores, abs=2e-3)

    # Plain transformers, no cache code: log p(continuation | context) from one forward over both, for the
    # exact (context, continuation) strings lm-eval built for each choice.
    tokenizer = smollm[1]
    plain, correct = [], 0
    for sample in samples:
        totals = []
        for context, continuation in sample["arguments"]:
            context_ids = tokenizer(context)["input_ids"]
            whole = tokenizer(context + continuation)["input_ids"]
            with torch.no_grad():
                logprobs = torch.log_softmax(reference(torch.tensor([whole])).logits[0].float(), -1)
            targets = torch.tensor(whole[len(context_ids) :])
            totals.append(float(logprobs[len(context_ids) - 1 : -1].gather(1, targets[:, None]).sum()))
        plain.extend(totals)
        target = sample["target"]  # the gold choice's text
        choices = [continuation.strip() for _, continuation in sample["arguments"]]
        gold = target if isinstance(target, int) else choices.index(str(target).strip())
        correct += int(max(range(len(totals)), key=totals.__getitem__) == gold)
    assert our_scores == pytest.approx(plain, abs=2e-3)
    assert ours["acc,none"] == pytest.approx(correct / len(samples))
