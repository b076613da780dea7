"""Token-by-token generation over the H2O cache (greedy, temperature, top-p), yielding ids as they come."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tokenizers.decoders import DecodeStream
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

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


def warpers(sampling: Sampling) -> LogitsProcessorList:
    """transformers' own temperature and top-p warpers, in the order `generate` applies them."""
    steps = LogitsProcessorList()
    if sampling.temperature not in (0, 1):
        steps.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_p < 1:
        steps.append(TopPLogitsWarper(sampling.top_p))
    return steps


def pick_token(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
    steps: LogitsProcessorList | None = None,
) -> int:
    """Next id from logits [vocab]: argmax, or a draw from the warped distribution as `generate` samples."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    steps = warpers(sampling) if steps is None else steps
    scores = steps(None, logits.float()[None])  # the warpers read scores [batch, vocab], not the ids
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)[0])


@torch.inference_mode()
def generate_ids(
    model,
    cache: H2OCache,
    logits: torch.Tensor,
    sampling: Sampling,
    stop_ids: set[int] = frozenset(),
    step: Callable[[int], torch.Tensor] | None = None,
) -> Iterator[int]:
    """Yield new ids, starting from the logits after the prompt; each id is fed back through the cache.

    The last yielded id is already in the cache when the caller asks for the next one, so stopping early
    (Ctrl-C, a stop id) leaves the cache consistent with what was shown. Each step runs on the cache's
    `decode_threads` choice (h2o_cli.cache.threads); the first, which packs the cache after the prompt, is not timed.
    `step`: feeds one id and returns the logits [vocab] instead of the model's forward (`CompiledStep`).
    """
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=logits.device).manual_seed(sampling.seed)
    steps = warpers(sampling)
    for number in range(sampling.max_new_tokens):
        token = pick_token(logits, sampling, generator, steps)
        if token in stop_ids:
            return
        if step is not None:
            logits = step(token)
            yield token
            continue
        input_ids = torch.tensor([[token]], dtype=torch.long, device=model.device)
        with cache.decode_threads.step(timed=number > 0):
            logits = model(input_ids=input_ids, cache=cache, use_cache=True).logits[0, -1]
        yield token


class TextStreamer:
    """Turns ids, one at a time, into printable text increments; `printed` is all the text so far.

    A fast tokenizer decodes incrementally (`tokenizers.decoders.DecodeStream`: constant work per token, and a
    character split over several tokens comes out whole). A slow one re-decodes the answer each token (O(n²)).
    Either way the text equals `tokenizer.decode(ids, skip_special_tokens=True)`.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = ""
        backend = getattr(tokenizer, "_tokenizer", None)
        cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)  # decode() rewrites " ," etc.
        self._stream = DecodeStream(skip_special_tokens=True) if backend is not None and not cleanup else None
        self._backend = backend

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self._stream is not None:
            new = self._stream.step(self._backend, token) or ""  # None: an unfinished UTF-8 sequence
            self.printed += new
            return new
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for the next token
            return ""
        new, self.printed = text[len(self.printed) :], text
        return new
