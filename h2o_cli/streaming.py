"""Stream token ids through the cache in chunks: perplexity (SPEC.md) or read-then-generate."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from h2o_cli.cache import H2OCache
from h2o_cli.errors import H2OError
from h2o_cli.prompting import NewChunk


@dataclass
class StreamStats:
    """What a stream has done so far; `ppl` is exp(mean NLL) over the predictions made."""

    tokens: int = 0
    predictions: int = 0
    nll: float = 0.0
    seconds: float = 0.0
    interrupted: bool = False
    error: str | None = None
    failure: H2OError | None = field(default=None, repr=False)  # the error that ended the stream, if any
    started: float = field(default_factory=time.perf_counter, repr=False)

    def reraise(self) -> None:
        """Raise what ended the stream early (KeyboardInterrupt, or the `H2OError`), if anything did: for
        callers that need the whole read or nothing."""
        if self.interrupted:
            raise KeyboardInterrupt
        if self.failure is not None:
            raise self.failure

    @property
    def mean_nll(self) -> float:
        return self.nll / self.predictions if self.predictions else float("nan")

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll) if self.predictions else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class AskingChunk(list):
    """A chunk whose last `asks` ids are a question (a `NewChunk` piece read with the text before it): a
    `recall` cache chooses what to bring back with their queries alone (`H2OCache.asking`)."""

    asks: int = 0


def chunks_of(pieces: Iterable[list[int]], size: int, limit: int | None = None) -> Iterator[list[int]]:
    """Regroup id lists into lists of exactly `size` ids (the last may be shorter), stopping after `limit`. A
    `NewChunk` piece (a question) of at least two ids ends the list it lands in: it joins the ids before it when
    it fits in the list's room (an `AskingChunk`, `asks` = its length), else it starts a list of its own (the
    one before it may be shorter)."""
    buffer: list[int] = []
    taken = 0
    for piece in pieces:
        asks = len(piece) if isinstance(piece, NewChunk) and len(piece) >= 2 else 0
        if isinstance(piece, NewChunk) and buffer and len(buffer) + len(piece) > size:
            yield buffer
            buffer = []
        if limit is not None:
            piece = piece[: limit - taken]
        taken += len(piece)
        buffer.extend(piece)
        if asks and len(buffer) <= size and len(piece) == asks:
            chunk = AskingChunk(buffer)
            chunk.asks = asks
            yield chunk
            buffer = []
        while len(buffer) >= size:
            yield buffer[:size]
            buffer = buffer[size:]
        if limit is not None and taken >= limit:
            break
    if buffer:
        yield buffer


@torch.inference_mode()
def forward_chunk(model, cache: H2OCache, ids: list[int]) -> torch.Tensor:
    """Run one chunk through the model and cache. Returns float32 logits [chunk, vocab]."""
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
    return model(input_ids=input_ids, cache=cache, use_cache=True).logits[0].float()


def _chunk_logits(model, cache: H2OCache, ids: list[int], step) -> torch.Tensor:
    """float32 logits [chunk, vocab] of a chunk: a one-id chunk through `step` when given, else the forward."""
    if step is not None and len(ids) == 1:
        return step(ids[0]).float()[None]
    return forward_chunk(model, cache, ids)


def _chunk_nll(
    logits: torch.Tensor, ids: list[int], previous: torch.Tensor | None
) -> tuple[float, torch.Tensor]:
    """NLL of a chunk's ids from its logits [chunk, vocab] (its first id from `previous` [vocab] log-probs).

    Returns the NLL and a copy of the last row's log-probs [vocab]: a view would keep the whole
    [chunk, vocab] block alive through the next chunk's forward pass.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(ids, device=logprobs.device)
    nll = -logprobs[:-1].gather(1, targets[1:, None]).sum()
    if previous is not None:
        nll = nll - previous[targets[0]]
    return float(nll), logprobs[-1].clone()


@torch.inference_mode()
def stream_perplexity(
    model,
    cache: H2OCache,
    pieces: Iterable[list[int]],
    chunk: int,
    max_tokens: int | None = None,
    on_chunk: Callable[[StreamStats], None] | None = None,
    step: Callable[[int], torch.Tensor] | None = None,
) -> StreamStats:
    """Feed ids through the cache `chunk` at a time and accumulate the NLL of each next token.
    `step`: feeds a one-id chunk instead of the model's forward and returns its logits [vocab]
    (`h2o_cli.compiled.CompiledStep`).

    Token i+1 is scored from the output at token i (SPEC.md). On Ctrl-C or a cache error the stats so far
    are returned with `interrupted` / `error` set, so a partial stream still reports what it read.
    """
    stats = StreamStats()
    previous: torch.Tensor | None = None  # log-probs [vocab] at the last token of the previous chunk
    try:
        for ids in chunks_of(pieces, chunk, max_tokens):
            nll, last = _chunk_nll(_chunk_logits(model, cache, ids, step), ids, previous)
            stats.nll += nll
            stats.predictions += len(ids) - 1 + (previous is not None)
            stats.tokens += len(ids)
            previous = last
            stats.seconds = time.perf_counter() - stats.started
            if on_chunk is not None:
                on_chunk(stats)
    except KeyboardInterrupt:
        stats.interrupted = True
    except H2OError as error:  # bad bytes mid-stream, context overflow: keep what was read
        stats.error, stats.failure = str(error), error
    stats.seconds = time.perf_counter() - stats.started
    return stats


@torch.inference_mode()
def prefill(
    model,
    cache: H2OCache,
    pieces: Iterable[list[int]],
    chunk: int,
    max_tokens: int | None = None,
    on_chunk: Callable[[StreamStats], None] | None = None,
) -> tuple[torch.Tensor | None, StreamStats]:
    """Read ids into the cache without scoring. Returns the logits [vocab] after the last token read, and the
    stats. As in `stream_perplexity`, Ctrl-C or a cache/input error ends the read early with `interrupted` /
    `error` (and the error itself in `failure`) set, so a partial read still reports what it read."""
    stats = StreamStats()
    last = None
    try:
        for ids in chunks_of(pieces, chunk, max_tokens):
            input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
            asks = getattr(ids, "asks", 0)
            asking = asks and isinstance(cache, H2OCache)
            again = asking and asks > 1 and cache.report().has_lead
            if again:  # read the question once for the lead head's ranking, put the cache back, read it again
                state = cache.state()
                with cache.asking(asks):
                    model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
                cache.restore(state)
            with cache.asking(asks, again=again) if asking else nullcontext():
                output = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
            last = output.logits[0, -1].float()
            stats.tokens += len(ids)
            stats.seconds = time.perf_counter() - stats.started
            if on_chunk is not None:
                on_chunk(stats)
    except KeyboardInterrupt:
        stats.interrupted = True
    except H2OError as error:
        stats.error, stats.failure = str(error), error
    stats.seconds = time.perf_counter() - stats.started
    return last, stats
