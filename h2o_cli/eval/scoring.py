"""Scoring through the H2O cache: per-example budgets, continuation log-likelihoods, greedy answers, CIs.

Protocol (SPEC.md, the paper's): the budget is a fraction of each example's prompt. The prompt is prefilled
in chunks with the cache evicting as it goes (heavy hitters are picked during prefill); continuations are
then teacher-forced through the same cache, which keeps evicting.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence

import torch

from h2o_cli.cache import H2OCache
from h2o_cli.cache.families import context_window
from h2o_cli.config import CacheSettings
from h2o_cli.generation import Sampling, TextStreamer, generate_ids
from h2o_cli.streaming import chunks_of, forward_chunk


class CachePool:
    """Builds the cache for each example from one `CacheSettings` (its budget a fraction of each prompt)."""

    def __init__(self, model, settings: CacheSettings) -> None:
        self.model = model
        self.settings = settings
        self.window = context_window(model)

    def cache_for(self, prompt_tokens: int, extra_tokens: int = 0) -> H2OCache:
        """A cache for a prompt followed by `extra_tokens` (continuation or answer): the budget is resolved
        against the prompt; a policy that never evicts holds the whole example, not the whole window."""
        settings = self.settings.resolved(prompt_tokens, floor=True)
        return H2OCache(self.model, settings, span=prompt_tokens + extra_tokens)


def budget_used(cache: H2OCache, prompt_tokens: int) -> int:
    """Tokens of the prompt attention reads per head besides the chunk (all of it for a cache that never
    evicts; the resident entries and the recall slots for `recall`)."""
    return min(prompt_tokens, cache.report().budget_tokens)


@torch.inference_mode()
def prefill_logits(model, cache: H2OCache, ids: Sequence[int], chunk: int) -> torch.Tensor:
    """Read `ids` in chunks; the float32 log-probs after the last one [vocab]."""
    logits = None
    for piece in chunks_of([list(ids)], chunk):
        logits = forward_chunk(model, cache, piece)[-1]
    return torch.log_softmax(logits, dim=-1)


@torch.inference_mode()
def continuation_scores(
    model, cache: H2OCache, context: Sequence[int], continuations: Sequence[Sequence[int]], chunk: int
) -> list[tuple[float, bool]]:
    """(sum log p(continuation | context), every continuation token greedy) per continuation.

    The context is prefilled once; each continuation starts from a snapshot of that state.
    """
    first = prefill_logits(model, cache, context, chunk)
    state = cache.state() if len(continuations) > 1 else None
    results = []
    for number, continuation in enumerate(continuations):
        if number and state is not None:
            cache.restore(state)
        logprobs = [first]
        for piece in chunks_of([list(continuation[:-1])], chunk):
            logprobs.extend(torch.log_softmax(forward_chunk(model, cache, piece), dim=-1))
        target = torch.tensor(list(continuation))
        table = torch.stack(logprobs)
        total = float(table.gather(1, target[:, None]).sum())
        greedy = bool((table.argmax(-1) == target).all())
        results.append((total, greedy))
    return results


@torch.inference_mode()
def greedy_answer(
    model,
    tokenizer,
    cache: H2OCache,
    context: Sequence[int],
    max_new_tokens: int,
    chunk: int,
    until: Sequence[str] = (),
) -> str:
    """Greedy text after `context`, cut at the first stop string (or the tokenizer's end token)."""
    logits = prefill_logits(model, cache, context, chunk)
    streamer = TextStreamer(tokenizer)
    stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    text = ""
    for token in generate_ids(model, cache, logits, Sampling(max_new_tokens=max_new_tokens), stop_ids):
        text += streamer.push(token)
        if any(stop in text for stop in until):
            break
    for stop in until:
        text = text.split(stop)[0]
    return text


def wilson_interval(accuracy: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval (scipy's) of a proportion of successes measured on `n` examples."""
    from scipy.stats import binomtest

    if n == 0 or math.isnan(accuracy):
        return float("nan"), float("nan")
    interval = binomtest(round(accuracy * n), n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(interval.low), float(interval.high)


def normalize_answer(text: str) -> str:
    """SQuAD/lost-in-the-middle normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    return any(normalize_answer(prediction) == normalize_answer(answer) for answer in answers)


def contains_answer(prediction: str, answers: Sequence[str]) -> bool:
    """lost-in-the-middle's best_subspan_em: a normalised answer occurs in the normalised prediction."""
    normalized = normalize_answer(prediction)
    return any(normalize_answer(answer) in normalized for answer in answers)
