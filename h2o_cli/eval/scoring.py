"""Scoring through the H2O cache: per-example budgets, continuation log-likelihoods, greedy answers, CIs.

Protocol (SPEC.md, the paper's): the budget is a fraction of each example's prompt. The prompt is prefilled
in chunks with the cache evicting as it goes (heavy hitters are picked during prefill); continuations are
then teacher-forced through the same cache, which keeps evicting.

What it costs (docs/benchmarks.md): a forward call of a small model costs about one read of its weights plus a
little per token, so a short context is read again with each choice in one call (`CachePool.scores`, as
lm-eval's own `hf` model does), the layer splitting the call where a separate prefill would have ended; a long
context is prefilled once and every choice continues from a snapshot of it.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from dataclasses import replace

import torch

from h2o_cli.cache import H2OCache
from h2o_cli.cache.families import context_window
from h2o_cli.config import CacheSettings
from h2o_cli.generation import Sampling, TextStreamer, generate_ids
from h2o_cli.policies import make_policy, policy_class
from h2o_cli.prompting import NewChunk
from h2o_cli.streaming import chunks_of, forward_chunk, prefill


class CachePool:
    """Builds the cache for each example from one `CacheSettings` (its budget a fraction of each prompt)."""

    def __init__(self, model, settings: CacheSettings) -> None:
        self.model = model
        self.settings = settings
        self.window = context_window(model)
        self.joint_tokens = JOINT_TOKENS  # -1: always prefill the context once (for comparisons)

    def cache_for(self, prompt_tokens: int, extra_tokens: int = 0, chunk: int | None = None) -> H2OCache:
        """A cache for a prompt followed by `extra_tokens` (continuation or answer): the budget is resolved
        against the prompt; a policy that never evicts holds the whole example, not the whole window.
        `chunk` overrides the settings' (the slots past the budget; `joint_chunk`)."""
        settings = self.settings.resolved(prompt_tokens, floor=True)
        if chunk is not None:
            settings = replace(settings, chunk=chunk)
        return H2OCache(self.model, settings, span=prompt_tokens + extra_tokens)

    def budget_for(self, prompt_tokens: int, extra_tokens: int = 0) -> int:
        """The resident slots of `cache_for(prompt_tokens, extra_tokens)`, without building it."""
        policy = make_policy(self.settings.resolved(prompt_tokens, floor=True).resolved(self.window))
        return policy.kept_tokens(min(prompt_tokens + extra_tokens, self.window))

    def joint_chunk(self, context_tokens: int, fed_tokens: int) -> int | None:
        """The cache chunk with which ONE forward call of a context and `fed_tokens` continuation tokens is
        processed exactly as the context prefilled alone, then the continuation teacher-forced: or None.

        A layer processes a call in sub-chunks that fit its free slots (`budget + chunk`), evicting after each,
        exactly as if the caller had sent them one by one (`H2OLayer.attend`). With `chunk = context - budget`
        the first sub-chunk is the context and the continuation fits in the slots eviction then frees; when
        nothing is evicted after the context (it fits in the budget), one sub-chunk reads the same entries.
        None when the separate calls would themselves be split (over `settings.chunk`) or the continuation
        would not fit, and for a recalling policy (its archive and recall slots follow the calls).
        """
        chunk, span = self.settings.chunk, context_tokens + fed_tokens + 1
        if policy_class(self.settings.policy).recalls or context_tokens > chunk or fed_tokens > chunk:
            return None
        free = context_tokens - self.budget_for(context_tokens, fed_tokens + 1)
        if free <= 0:  # nothing evicted after the context
            return chunk if span <= self.window else None
        return free if fed_tokens <= free else None

    def scores(
        self, context: Sequence[int], continuations: Sequence[Sequence[int]]
    ) -> tuple[list[tuple[float, bool]], int]:
        """`continuation_scores` of the continuations after `context`, and the cache's `budget_used`, by the
        cheaper of: one call per continuation with the context read again (`joint_scores`, while
        `(choices - 1) * context <= JOINT_TOKENS` and `joint_chunk` finds a split), or one prefill of the
        context shared by every continuation. The same scores either way, to float rounding."""
        longest = max(len(continuation) for continuation in continuations)
        joint = self.joint_chunk(len(context), longest - 1)
        if joint is not None and (len(continuations) - 1) * len(context) <= self.joint_tokens:
            cache = self.cache_for(len(context), longest, chunk=joint)
            return joint_scores(self.model, cache, context, continuations), budget_used(cache, len(context))
        cache = self.cache_for(len(context), longest)
        scored = continuation_scores(self.model, cache, context, continuations, self.settings.chunk)
        return scored, budget_used(cache, len(context))


# A forward call of SmolLM2-135M on 2 CPU threads costs ~90 ms (one read of the weights) + ~2 ms per token:
# reading a context again for each further choice beats one more call while that adds up to ~45 tokens.
JOINT_TOKENS = 48


def budget_used(cache: H2OCache, prompt_tokens: int) -> int:
    """Tokens of the prompt attention reads per head besides the chunk (all of it for a cache that never
    evicts; the resident entries and the recall slots for `recall`)."""
    return min(prompt_tokens, cache.report().budget_tokens)


@torch.inference_mode()
def prefill_logits(model, cache: H2OCache, ids: Sequence[int], chunk: int) -> torch.Tensor:
    """Read `ids` in chunks; the float32 log-probs after the last one [vocab]."""
    logits = None
    for piece in chunks_of([list(ids)], chunk):  # the last row only: the others' logits go unread
        logits = forward_tail(model, cache, piece, 1)[-1]
    return torch.log_softmax(logits, dim=-1)


def forward_tail(model, cache: H2OCache, ids: Sequence[int], rows: int) -> torch.Tensor:
    """`forward_chunk`'s float32 logits of the last `rows` of `ids` only [rows, vocab] (the output layer is
    a large share of a small model's call)."""
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    return model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=rows).logits[0].float()


def _score(table: torch.Tensor, continuation: Sequence[int]) -> tuple[float, bool]:
    """(sum of the continuation's log-probs, every token greedy) from its log-prob rows [len, vocab]."""
    target = torch.tensor(list(continuation), device=table.device)
    total = float(table.gather(1, target[:, None]).sum())
    return total, bool((table.argmax(-1) == target).all())


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
        results.append(_score(torch.stack(logprobs), continuation))
    return results


@torch.inference_mode()
def joint_scores(
    model, cache: H2OCache, context: Sequence[int], continuations: Sequence[Sequence[int]]
) -> list[tuple[float, bool]]:
    """`continuation_scores` with the context and each continuation in one forward call, the cache emptied
    between them: equal when the cache comes from `CachePool.joint_chunk`'s chunk (its layers split the call
    after the context)."""
    results = []
    for number, continuation in enumerate(continuations):
        if number:
            cache.reset()
        logits = forward_tail(model, cache, [*context, *continuation[:-1]], len(continuation))
        results.append(_score(torch.log_softmax(logits, dim=-1), continuation))
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
    question: Sequence[int] = (),
) -> str:
    """Greedy text after `context` and `question`, cut at the first stop string (or the tokenizer's end
    token). `question`: ids read as a question after the context (`prompting.NewChunk`, as `h2o stream
    --prompt` reads one: a `recall` cache chooses with their queries)."""
    logits, stats = prefill(model, cache, [list(context), NewChunk(question)], chunk)
    stats.reraise()
    return greedy_continuation(model, tokenizer, cache, logits, max_new_tokens, until)


def greedy_continuation(
    model, tokenizer, cache: H2OCache, logits: torch.Tensor, max_new_tokens: int, until: Sequence[str] = ()
) -> str:
    """`greedy_answer` after its read: greedy text from `logits` (the cache has read the prompt), cut at the
    first stop string (or the tokenizer's end token)."""
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
