"""`stream --ppl` on the embedded model against the naive SPEC.md simulation and against plain transformers."""

from __future__ import annotations

import math

import pytest
import torch
from naive import naive_model_nll, ppl

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.streaming import stream_perplexity

TOKENS = 112
CASES = [
    dict(policy="full", positions="original"),
    dict(policy="local", positions="rolling"),
    dict(policy="sink", positions="rolling"),
    dict(policy="h2o", positions="rolling"),
    dict(policy="h2o", positions="original"),
]


@pytest.fixture(scope="module")
def excerpt_ids(smollm, excerpt):
    _, tokenizer = smollm
    return tokenizer(excerpt)["input_ids"][:TOKENS]


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: f"{o['policy']}-{o['positions']}")
def test_stream_ppl_chunk1_matches_naive(smollm, excerpt_ids, overrides):
    model, _ = smollm
    settings = CacheSettings(budget=40, chunk=1, sinks=4, **overrides)
    stats = stream_perplexity(model, H2OCache(model, settings), [excerpt_ids], chunk=1)
    want = ppl(naive_model_nll(model, excerpt_ids, settings))
    assert stats.predictions == TOKENS - 1
    assert stats.ppl == pytest.approx(want, rel=5e-3)


def plain_transformers_ppl(model_path_model, ids: list[int]) -> float:
    """Perplexity from a plain sdpa model with no cache code (labels= gives the mean NLL)."""
    with torch.no_grad():
        out = model_path_model(torch.tensor([ids]), labels=torch.tensor([ids]))
    return math.exp(float(out.loss))


@pytest.fixture(scope="module")
def plain_smollm(smollm):
    import copy

    from transformers import AutoModelForCausalLM

    model, _ = smollm
    config = copy.deepcopy(model.config)
    config._attn_implementation = "sdpa"
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    plain.load_state_dict(model.state_dict())
    return plain


@pytest.mark.parametrize(
    "overrides",
    [
        dict(policy="full"),
        dict(policy="h2o", budget=600),
        dict(policy="local", budget=600, positions="original"),
    ],
    ids=["full", "h2o-covering-budget", "local-covering-budget"],
)
def test_covering_budget_equals_plain_transformers(smollm, plain_smollm, excerpt, overrides):
    model, tokenizer = smollm
    ids = tokenizer(excerpt)["input_ids"][:512]
    settings = CacheSettings(**{"budget": 64, "chunk": 128, "positions": "original", **overrides})
    stats = stream_perplexity(model, H2OCache(model, settings), [ids], chunk=128)
    assert stats.ppl == pytest.approx(plain_transformers_ppl(plain_smollm, ids), rel=1e-4)


def test_greedy_generate_identical_to_transformers(smollm, plain_smollm, excerpt):
    model, tokenizer = smollm
    ids = torch.tensor([tokenizer(excerpt)["input_ids"][:120]])
    cache = H2OCache(model, CacheSettings(budget=8192, policy="full", positions="original", chunk=256))
    ours = model.generate(ids, past_key_values=cache, max_new_tokens=24, do_sample=False)
    theirs = plain_smollm.generate(ids, max_new_tokens=24, do_sample=False)
    assert ours[0, 120:].tolist() == theirs[0, 120:].tolist()
