"""h2o against plain transformers in one process: paired decode, stream speed, and the byte model bounding both.

Decode on a CPU is bound by the bytes read per token: the weights plus the resident K/V. A cache that keeps
`budget` of `context` tokens and costs nothing would decode `ByteModel.ceiling(context, budget)` times
faster than a full cache; a measured copy bandwidth turns bytes per token into a time floor, so the share of
that floor each side reaches shows the headroom left.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from h2o_cli.cache import H2OCache, compute_dtype
from h2o_cli.cache.families import text_config
from h2o_cli.memory import ModelShape, token_kv_bytes
from h2o_cli.runtime import make_settings
from h2o_cli.streaming import prefill, stream_perplexity


@dataclass(frozen=True)
class ByteModel:
    """Bytes a decode step reads: every weight once, and the K/V of every resident token."""

    weight_bytes: int
    kv_bytes_per_token: int  # K and V of one token in every layer and KV head

    @classmethod
    def of(cls, model) -> ByteModel:
        shape = ModelShape.from_config(text_config(model))
        dtype_bytes = compute_dtype(model).itemsize
        weights = sum(param.numel() * param.element_size() for param in model.parameters())  # tied once
        return cls(weights, shape.n_layers * shape.n_kv_heads * token_kv_bytes(shape, None, dtype_bytes))

    def bytes_per_token(self, resident: int) -> int:
        """Bytes read by one decode step with `resident` cached tokens per KV head."""
        return self.weight_bytes + resident * self.kv_bytes_per_token

    def ceiling(self, context: int, budget: int) -> float:
        """Speed-up over a full cache of `context` tokens of a free cache keeping `budget`."""
        return self.bytes_per_token(context) / self.bytes_per_token(budget)


def floor_share(bytes_per_token: int, tokens_per_s: float, bandwidth: float) -> float:
    """The bandwidth floor's share of the measured time per token: bytes/token ÷ bandwidth × tokens/s."""
    return bytes_per_token * tokens_per_s / bandwidth


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Bytes/s of the fastest of `repeats` copies of an `nbytes` float32 tensor, counting read and write."""
    source = torch.ones(nbytes // 4, device=device)
    target = torch.empty_like(source)
    sync = torch.cuda.synchronize if source.is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        target.copy_(source)
        sync()
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best


@contextmanager
def plain_attention(model):
    """The model on transformers' own sdpa attention (what a `DynamicCache` needs), restored afterwards."""
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def fill(model, cache, ids: list[int], chunk: int) -> int:
    """Read `ids` into `cache` in chunks of `chunk`; returns the greedy next token."""
    logits, stats = prefill(model, cache, [ids], chunk)
    stats.reraise()
    return int(logits.argmax())


@torch.inference_mode()
def greedy_decode(model, cache, token: int, tokens: int) -> tuple[float, int]:
    """Decode `tokens` greedy tokens one at a time from `token`. Returns (tokens/s, the next token).
    An `H2OCache` decodes on its `decode_threads` choice, as `generate_ids` does (plain transformers on
    torch's thread count, as a user of it would)."""
    threads = getattr(cache, "decode_threads", None)
    started = time.perf_counter()
    for number in range(tokens):
        input_ids = torch.tensor([[token]], device=model.device)
        with threads.step(timed=number > 0) if threads is not None else contextlib.nullcontext():
            logits = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
    return tokens / (time.perf_counter() - started), token


def h2o_budget(context: int, fraction: float) -> int:
    return max(2, round(context * fraction))


class PlainSide:
    """Plain transformers through one round: one `DynamicCache`, topped up from the book to each context."""

    def __init__(self, model, ids: list[int], tokens: int, chunk: int) -> None:
        self.model, self.ids, self.tokens, self.chunk = model, ids, tokens, chunk
        self.cache, self.seen = DynamicCache(config=model.config), 0

    def decode(self, context: int) -> float:
        with plain_attention(self.model):
            token = fill(self.model, self.cache, self.ids[self.seen : context], self.chunk)
            speed, _ = greedy_decode(self.model, self.cache, token, self.tokens)
        self.seen = context + self.tokens
        return speed


def h2o_decode(
    model, ids: list[int], context: int, budget: int, tokens: int, chunk: int, kernels: str
) -> tuple[float, int | None]:
    """tokens/s of h2o decode after reading `context` ids into a fresh cache keeping `budget` tokens, and the
    decode thread count its `decode_threads` chose (None: still measuring at the end)."""
    cache = H2OCache(model, make_settings(model, str(budget), chunk=chunk, kernels=kernels))
    speed = greedy_decode(model, cache, fill(model, cache, ids[:context], chunk), tokens)[0]
    return speed, cache.decode_threads.chosen


def paired_decode(
    model,
    ids: list[int],
    contexts: tuple[int, ...],
    fraction: float,
    tokens: int,
    rounds: int,
    chunk: int,
    kernels: str = "auto",
    progress: Callable[[str], None] = print,
) -> list[dict]:
    """Decode speed of plain transformers (sdpa, `DynamicCache`) and h2o at `fraction` of each context.

    Each round reads the contexts in increasing order; plain transformers keeps one cache through the round
    (topped up from the book to the next context after its decode), h2o gets a fresh cache per context.
    Rounds alternate which side goes first. Returns one row per (round, context).
    """
    assert list(contexts) == sorted(contexts), "contexts in increasing order"
    assert all(b - a > tokens for a, b in zip(contexts, contexts[1:], strict=False)), "contexts too close"
    rows = []
    for number in range(rounds):
        plain = PlainSide(model, ids, tokens, chunk)
        for context in contexts:
            budget = h2o_budget(context, fraction)
            progress(f"round {number + 1}: context {context}, plain transformers and h2o (budget {budget})")
            order = ("plain", "h2o") if number % 2 == 0 else ("h2o", "plain")
            speeds = {}
            for name in order:
                if name == "plain":
                    speeds[name] = plain.decode(context)
                else:
                    speeds[name], speeds["h2o_threads"] = h2o_decode(
                        model, ids, context, budget, tokens, chunk, kernels
                    )
            rows.append({"round": number + 1, "context": context, "budget": budget, "first": order[0],
                         **speeds, "ratio": speeds["h2o"] / speeds["plain"]})  # fmt: skip
    return rows


def stream_speed(
    model, ids: list[int], tokens: int, chunk: int, budget: str = "0.1", kernels: str = "auto"
) -> dict:
    """tokens/s and perplexity of `h2o stream --ppl` (budget of the context window, SPEC.md) and of plain
    transformers' chunked full-attention forward over the same first `tokens` ids, same chunk."""
    ids = ids[:tokens]
    cache = H2OCache(model, make_settings(model, budget, chunk=chunk, kernels=kernels))
    h2o = stream_perplexity(model, cache, [ids], chunk)
    h2o.reraise()
    with plain_attention(model):
        plain = stream_perplexity(model, DynamicCache(config=model.config), [ids], chunk)
    plain.reraise()
    return {"tokens": tokens, "chunk": chunk, "budget": budget,
            "h2o": h2o.tokens_per_s, "h2o_ppl": h2o.ppl, "plain": plain.tokens_per_s, "plain_ppl": plain.ppl,
            "ratio": h2o.tokens_per_s / plain.tokens_per_s}  # fmt: skip


def summary(rows: list[dict], byte_model: ByteModel, bandwidth: float) -> list[dict]:
    """Per context: median speeds and ratio over the rounds, the byte-model ceiling, and each side's share
    of its bandwidth floor (at the median speed)."""
    out = []
    for context in dict.fromkeys(row["context"] for row in rows):
        mine = [row for row in rows if row["context"] == context]
        budget = mine[0]["budget"]
        plain = statistics.median(row["plain"] for row in mine)
        h2o = statistics.median(row["h2o"] for row in mine)
        plain_bytes, h2o_bytes = byte_model.bytes_per_token(context), byte_model.bytes_per_token(budget)
        out.append({"context": context, "budget": budget, "rounds": len(mine), "plain": plain, "h2o": h2o,
                    "ratio": statistics.median(row["ratio"] for row in mine),
                    "ceiling": byte_model.ceiling(context, budget),
                    "plain_bytes": plain_bytes, "h2o_bytes": h2o_bytes,
                    "plain_floor": floor_share(plain_bytes, plain, bandwidth),
                    "h2o_floor": floor_share(h2o_bytes, h2o, bandwidth)})  # fmt: skip
    return out


def markdown(
    rows: list[dict], medians: list[dict], stream: dict | None, byte_model: ByteModel, bandwidth: float,
    threads: int, tokens: int, chunk: int, fraction: float,
) -> list[str]:  # fmt: skip
    """The speed tables of `h2o bench` (lines of markdown)."""
    lines = [
        f"Plain transformers (sdpa attention, `DynamicCache`) vs h2o at {fraction:.0%} of the context: greedy "
        f"decode of {tokens} tokens after a chunked prefill (chunk {chunk}), same model and process, rounds "
        f"alternating which goes first; torch threads {threads} (plain transformers and every prefill; h2o's "
        "decode steps run on the count its `--decode-threads auto` measured fastest, the first 7 steps "
        f"measuring). Byte model: {byte_model.weight_bytes / 1e6:,.0f} MB of weights + {byte_model.kv_bytes_per_token / 1e3:,.1f} KB of K/V per resident token (plain: the "
        f"context, h2o: the budget); measured copy bandwidth {bandwidth / 1e9:,.1f} GB/s (read + write). "
        "Share of floor = (bytes/token ÷ bandwidth) ÷ measured time per token.",
        "",
        "| context | round | first | plain tok/s | h2o tok/s (budget) | h2o decode threads | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['context']:,} | {row['round']} | {row['first']} | {row['plain']:.2f} | "
                     f"{row['h2o']:.2f} ({row['budget']}) | {row.get('h2o_threads') or 'measuring'} | "
                     f"{row['ratio']:.2f}× |")  # fmt: skip
    lines += [
        "",
        "| context | plain tok/s (median) | h2o tok/s (median) | ratio (median) | ceiling | plain MB/token | "
        "h2o MB/token | plain: share of floor | h2o: share of floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in medians:
        lines.append(f"| {m['context']:,} | {m['plain']:.2f} | {m['h2o']:.2f} | **{m['ratio']:.2f}×** | "
                     f"{m['ceiling']:.2f}× | {m['plain_bytes'] / 1e6:,.0f} | {m['h2o_bytes'] / 1e6:,.0f} | "
                     f"{m['plain_floor']:.0%} | {m['h2o_floor']:.0%} |")  # fmt: skip
    if stream is not None:
        lines += [
            "",
            f"`h2o stream --ppl` (budget {stream['budget']} of the context window) vs plain transformers' "
            f"chunked full-attention forward, first {stream['tokens']:,} tokens, chunk {stream['chunk']}: "
            f"h2o {stream['h2o']:.1f} tok/s (ppl {stream['h2o_ppl']:.3f}), plain {stream['plain']:.1f} tok/s "
            f"(ppl {stream['plain_ppl']:.3f}), ratio **{stream['ratio']:.2f}×**.",
        ]
    return lines
