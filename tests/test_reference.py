"""`stream --ppl` on the embedded model against the naive SPEC.md simulation and against plain transformers,
token by token: every prediction's NLL, not only their mean (a wrong eviction moves single tokens by ~1 nat)."""

from __future__ import annotations

import pytest
import torch
from naive import naive_model_nll

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.streaming import forward_chunk, stream_perplexity

TOKENS = 112
# fp32 forward vs the naive float64 softmax: measured <= 3.4e-5 nats per token; 6x headroom.
NLL_TOLERANCE = 2e-4
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
def test_stream_ppl_chunk1_matches_naive_per_token(smollm, excerpt_ids, overrides):
    """With chunk 1, each chunk adds one prediction: the running NLL's steps are the per-token NLLs."""
    model, _ = smollm
    settings = CacheSettings(budget=40, chunk=1, sinks=4, **overrides)
    running = [0.0]
    stats = stream_perplexity(
        model, H2OCache(model, settings), [excerpt_ids], chunk=1, on_chunk=lambda s: running.append(s.nll)
    )
    ours = [after - before for before, after in zip(running[1:], running[2:], strict=False)]
    want = naive_model_nll(model, excerpt_ids, settings)
    assert stats.predictions == len(ours) == len(want) == TOKENS - 1
    assert ours == pytest.approx(want, abs=NLL_TOLERANCE)


def cache_token_nll(model, cache: H2OCache, ids: list[int], chunk: int) -> list[float]:
    """NLL of each next token through the cache, `chunk` tokens per forward (as stream_perplexity feeds it)."""
    logprobs = torch.cat(
        [
            torch.log_softmax(forward_chunk(model, cache, ids[i : i + chunk]), -1)
            for i in range(0, len(ids), chunk)
        ]
    )
    return (-logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).tolist()


def plain_transformers_nll(plain, ids: list[int]) -> list[float]:
    """NLL of each next token from a plain sdpa model with no cache code, one forward over all of `ids`."""
    with torch.no_grad():
        logprobs = torch.log_softmax(plain(torch.tensor([ids])).logits[0].float(), -1)
    return (-logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).tolist()


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
    ours = cache_token_nll(model, H2OCache(model, settings), ids, chunk=128)
    assert ours == pytest.approx(plain_transformers_nll(plain_smollm, ids), abs=NLL_TOLERANCE)
    stats = stream_perplexity(model, H2OCache(model, settings), [ids], chunk=128)
    assert stats.nll == pytest.approx(sum(ours), rel=1e-5)  # stream_perplexity sums exactly these


def test_greedy_generate_identical_to_transformers(smollm, plain_smollm, excerpt):
    model, tokenizer = smollm
    ids = torch.tensor([tokenizer(excerpt)["input_ids"][:120]])
    cache = H2OCache(model, CacheSettings(budget=8192, policy="full", positions="original", chunk=256))
    ours = model.generate(ids, past_key_values=cache, max_new_tokens=24, do_sample=False)
    theirs = plain_smollm.generate(ids, max_new_tokens=24, do_sample=False)
    assert ours[0, 120:].tolist() == theirs[0, 120:].tolist()
