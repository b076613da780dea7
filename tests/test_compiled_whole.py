"""`--compile` on the whole embedded model: the step inductor compiles (what `h2o stream --compile` runs on a
CPU), all 30 layers, 300 tokens past a full cache, for every registered policy, against the eager read of
the same text token by token (the perplexity, the log-prob of each next token, the greedy token at each
step). The archive of a recalling policy is sized to the text (the span `stream --max-tokens` gives it), and
its page choice runs both branches: every ring page scored (the ring within the step shortlist, as with the
default shortlist of 512 pages below 8K tokens) and a shortlist shorter than the ring (`--shortlist 8`).
Inductor compiles the whole model in minutes per run on two CPU cores, so this is the `slow` tier; the
default suite traces the same step with dynamo on two layers (tests/test_compiled_step.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch._dynamo

from h2o_cli.cache import H2OCache
from h2o_cli.compiled import CompiledStep
from h2o_cli.config import CacheSettings
from h2o_cli.policy_registry import policy_class, policy_names
from h2o_cli.streaming import forward_chunk, stream_perplexity

BUDGET, PAST = 64, 300  # `--budget 64`, 300 tokens read past a full cache
FIGURES = ("length", "tokens_seen", "evictions")


SHORT_LIST = 8  # pages, fewer than the 23 of 364 tokens


def whole_model_runs() -> list:
    """(policy, shortlist) for every registered policy (the default shortlist); a recalling one with
    `SHORT_LIST` too."""
    runs = [pytest.param(name, None, id=name) for name in policy_names()]
    recalling = [name for name in policy_names() if policy_class(name).recalls]
    return runs + [pytest.param(name, SHORT_LIST, id=f"{name}-shortlist") for name in recalling]


class Recorded:
    """A `stream_perplexity` step that keeps the float32 logits [vocab] of every token it feeds."""

    def __init__(self, step) -> None:
        self.step, self.logits = step, []

    def __call__(self, token: int) -> torch.Tensor:
        logits = self.step(token).float()
        self.logits.append(logits)
        return logits


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Float rounding only, which 30 layers amplify at some tokens (tests/test_compiled_step.py's `same_logits`:
# the torch step and the chunk path already differ by up to 3e-4 of the largest |logit| at a step). So a
# next token's log-prob within 7e-4 of that scale at every step, the greedy token the eager one or a near
# tie of it.
LOGIT_SHARE = 7e-4


@pytest.mark.slow  # inductor compiles the whole model once per run: minutes each on two CPU cores
@pytest.mark.parametrize(("policy", "shortlist"), whole_model_runs())
def test_inductor_reads_the_whole_model_as_eager(smollm, excerpt, policy, shortlist):
    """`h2o stream --ppl --chunk 1 --budget 64 --max-tokens 364 [--shortlist 8] --compile` as a library call
    (no lead head in either cache: the fixed step takes none), against the eager read (the model's forward on
    the default path): the perplexity within 1e-3 relative, each next token's log-prob to float rounding of
    the logits' scale, the same greedy token at every step (or a near tie), the same counters."""
    model, tokenizer = smollm
    ids = tokenizer(excerpt).input_ids[: BUDGET + PAST]
    assert len(ids) == BUDGET + PAST
    settings = CacheSettings(budget=BUDGET, chunk=1, policy=policy, recall_lead="none")
    if shortlist is not None:
        settings = replace(settings, shortlist=shortlist)
    eager_cache, cache = (H2OCache(model, settings, archive_span=len(ids)) for _ in range(2))
    eager_step = Recorded(lambda token: forward_chunk(model, eager_cache, [token])[0])
    captured_step = Recorded(CompiledStep(model, cache))
    eager = stream_perplexity(model, eager_cache, [ids], 1, step=eager_step)
    captured = stream_perplexity(model, cache, [ids], 1, step=captured_step)
    assert not eager.error and not captured.error
    assert captured.predictions == eager.predictions == len(ids) - 1
    if policy_class(policy).recalls:  # which branch of the page choice the steps took (every layer recalls)
        archive = cache.layers[0].archive
        assert (archive.pages > archive.step_shortlist) == (shortlist is not None)
    mine, theirs = cache.report(), eager_cache.report()
    assert [getattr(mine, name) for name in FIGURES] == [getattr(theirs, name) for name in FIGURES]
    if policy_class(policy).evicts:
        assert mine.evictions >= PAST  # recall: past its resident set, smaller than the budget

    want, got = torch.stack(eager_step.logits), torch.stack(captured_step.logits)  # [tokens, vocab]
    targets = torch.tensor(ids[1:])[:, None]
    want_lp = torch.log_softmax(want[:-1], dim=-1).gather(1, targets)[:, 0]
    got_lp = torch.log_softmax(got[:-1], dim=-1).gather(1, targets)[:, 0]
    scale = want.abs().amax(dim=1)[:-1]
    off = (got_lp - want_lp).abs()
    worst = int(off.argmax())
    assert bool((off <= LOGIT_SHARE * scale).all()), (worst, float(off[worst]), float(scale[worst]))
    greedy, eager_greedy = got.argmax(dim=1), want.argmax(dim=1)
    for number in torch.nonzero(greedy != eager_greedy)[:, 0].tolist():  # near ties only
        row = want[number]
        assert float(row[eager_greedy[number]] - row[greedy[number]]) <= LOGIT_SHARE * float(row.abs().max())
    assert int((greedy != eager_greedy).sum()) <= 2, torch.nonzero(greedy != eager_greedy)[:, 0].tolist()
    assert captured.ppl == pytest.approx(eager.ppl, rel=1e-3)
