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
from dataclasses import dataclass

import torch

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings, parse_budget
from h2o_cli.generation import Sampling, TextStreamer, generate_ids
from h2o_cli.streaming import chunks_of, forward_chunk


@dataclass(frozen=True)
class EvalCache:
    """What to build a cache from for each example: `budget` is a fraction (<= 1) of the prompt or a count."""

    budget: float = 0.2
    policy: str = "h2o"
    heavy_ratio: float = 0.5
    sinks: int = 4
    positions: str = "rolling"
    score_norm: str = "sum"
    chunk: int = 256
    kv_bits: int | None = None  # K/V storage (CacheSettings.kv_bits): None = model dtype, 16, or 8

    def settings(self, prompt_tokens: int, window: int, extra_tokens: int = 0) -> CacheSettings:
        """CacheSettings for one prompt. Tiny prompts get at least 2 tokens (and keep sinks below the budget).

        `full` becomes a window as long as the whole example (prompt + `extra_tokens`) with original
        positions: nothing is ever evicted, so it is exact full attention without 8K empty slots per head.
        """
        if self.policy == "full":
            total = max(2, min(window, prompt_tokens + extra_tokens))
            return CacheSettings(
                budget=total, policy="local", positions="original", chunk=self.chunk, kv_bits=self.kv_bits
            )
        if self.budget <= 1:
            budget = max(2, round(self.budget * prompt_tokens))
        else:
            budget = parse_budget(self.budget, window)
        return CacheSettings(
            budget=budget,
            policy=self.policy,
            heavy_ratio=self.heavy_ratio,
            sinks=min(self.sinks, budget - 1),
            positions=self.positions,
            score_norm=self.score_norm,
            chunk=self.chunk,
            kv_bits=self.kv_bits,
        )


class CachePool:
    """Builds the cache for each example from one `EvalCache` spec."""

    def __init__(self, model, spec: EvalCache) -> None:
        self.model = model
        self.spec = spec
        self.window = int(model.config.get_text_config().max_position_embeddings)

    def cache_for(self, prompt_tokens: int, extra_tokens: int = 0) -> H2OCache:
        return H2OCache(self.model, self.spec.settings(prompt_tokens, self.window, extra_tokens))


def snapshot(cache: H2OCache) -> list[dict]:
    """The state of every layer store, up to its highest used slot (cheap for a mostly empty `full` cache)."""
    states = []
    for store in cache.stores:
        used = int(store.valid.any(0).nonzero().max()) + 1 if store.valid.any() else 0
        tensors = {name: getattr(store, name)[:, :used].clone() for name in store._state_names()}
        states.append(
            {
                "used": used,
                "tensors": tensors,
                "length": store.length,
                "tokens_seen": store.tokens_seen,
                "evictions": store.evictions,
            }
        )
    return states


def restore(cache: H2OCache, states: list[dict]) -> None:
    """Put back a `snapshot`: slots past the snapshot's used range are emptied."""
    for store, state in zip(cache.stores, states, strict=False):
        used = state["used"]
        for name, tensor in state["tensors"].items():
            getattr(store, name)[:, :used] = tensor
        store.valid[:, used:] = False
        store.token_index[:, used:] = -1
        store.length, store.tokens_seen, store.evictions = (
            state["length"],
            state["tokens_seen"],
            state["evictions"],
        )


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
    state = snapshot(cache) if len(continuations) > 1 else None
    results = []
    for number, continuation in enumerate(continuations):
        if number and state is not None:
            restore(cache, state)
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
