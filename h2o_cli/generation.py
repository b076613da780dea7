"""Token-by-token generation over the H2O cache (greedy, temperature, top-p), yielding ids as they come."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from h2o_cli.cache import H2OCache
from h2o_cli.errors import UsageError


@dataclass(frozen=True)
class Sampling:
    """`temperature == 0` is greedy decoding."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise UsageError(f"--max-new-tokens {self.max_new_tokens} must be >= 0")
        if self.temperature < 0:
            raise UsageError(f"--temperature {self.temperature} must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p {self.top_p} must lie in (0, 1]")


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Next id from logits [vocab]."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        outside = sorted_probs.cumsum(0) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0)
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate_ids(
    model,
    cache: H2OCache,
    logits: torch.Tensor,
    sampling: Sampling,
    stop_ids: set[int] = frozenset(),
) -> Iterator[int]:
    """Yield new ids, starting from the logits after the prompt; each id is fed back through the cache.

    The last yielded id is already in the cache when the caller asks for the next one, so stopping early
    (Ctrl-C, a stop id) leaves the cache consistent with what was shown.
    """
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=logits.device).manual_seed(sampling.seed)
    for _ in range(sampling.max_new_tokens):
        token = pick_token(logits, sampling, generator)
        if token in stop_ids:
            return
        input_ids = torch.tensor([[token]], dtype=torch.long, device=model.device)
        logits = model(input_ids=input_ids, cache=cache, use_cache=True).logits[0, -1]
        yield token


class TextStreamer:
    """Turns a growing list of ids into printable text increments (handles multi-token characters)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for the next token
            return ""
        new, self.printed = text[len(self.printed) :], text
        return new
