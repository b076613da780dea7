"""`loglikelihood_rolling` of the lm-eval model: the budget is a fraction of the document, and a cache that
cannot pass the context window scores long documents in lm-eval's own rolling windows."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_config
from naive import naive_model_nll

pytest.importorskip("lm_eval")


@pytest.fixture
def tiny_lm(smollm):
    """(reference with sdpa, tiny model for the cache) with SmolLM2's vocabulary, so its tokenizer works."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_config(
        vocab_size=len(smollm[1]), hidden_size=64, num_attention_heads=4, max_position_embeddings=64
    )
    reference = LlamaForCausalLM(config).eval()
    model = LlamaForCausalLM(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model, smollm[1]


def rolling(lm, text: str) -> float:
    from lm_eval.api.instance import Instance

    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    (score,) = lm.loglikelihood_rolling([request], disable_tqdm=True)
    return score


def test_budget_is_a_fraction_of_the_document_and_matches_the_naive_reference(tiny_lm, excerpt):
    from h2o_cli.config import CacheSettings
    from h2o_cli.eval.lm_eval_model import H2OLM

    _, model, tokenizer = tiny_lm
    lm = H2OLM(model=(model, tokenizer), budget=0.5, policy="h2o", chunk=1)
    ids = lm.tok_encode(excerpt[:150])
    score = rolling(lm, excerpt[:150])
    budget = round(0.5 * (len(ids) + 1))
    assert lm.budget_tokens == [budget] and budget > 10  # was 2: 20% of the 1-token prefix
    settings = CacheSettings(budget=budget, policy="h2o", chunk=1)
    want = -sum(naive_model_nll(model, [lm.prefix_token_id, *ids], settings))
    assert score == pytest.approx(want, rel=1e-4)


def test_full_scores_a_document_longer_than_the_window_in_rolling_windows(tiny_lm, excerpt):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from h2o_cli.eval.lm_eval_model import H2OLM

    reference, model, tokenizer = tiny_lm
    lm = H2OLM(model=(model, tokenizer), budget=0.2, policy="full", chunk=16)
    ids = lm.tok_encode(excerpt[:800])
    assert len(ids) > 2 * lm.max_length == 128
    want = 0.0
    windows = get_rolling_token_windows(ids, lm.prefix_token_id, lm.max_length, 1)
    with torch.no_grad():
        for context, continuation in map(make_disjoint_window, windows):
            whole = torch.tensor([context + continuation[:-1]])
            logprobs = torch.log_softmax(reference(whole).logits[0].double(), -1)[len(context) - 1 :]
            want += float(logprobs.gather(1, torch.tensor(continuation)[:, None]).sum())
    assert rolling(lm, excerpt[:800]) == pytest.approx(want, rel=1e-4)
