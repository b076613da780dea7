"""What a cache setting costs against another at the same budget (`recall` against `h2o`, by default): read
and decode tokens/s of several run specs in one process, taking turns so a shared machine's drifts fall on
all of them alike.

Per round: each run streams the text (then the question, as `h2o stream --prompt` asks one) through its own
cache, the caches taking turns in blocks of `read_block` tokens (each block timed); then every cache greedy-
decodes `decode` tokens, taking turns in blocks of `block` tokens. Read speed is all tokens over all the read's
time, with the interquartile range of the per-block ratios against the first run; decode speed is the median
over blocks, its ratio the median of the per-block ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.generation import Sampling, generate_ids
from h2o_cli.prompting import NewChunk
from h2o_cli.streaming import prefill


@dataclass(frozen=True)
class RunsPlan:
    """The runs compared (`POLICY[:FIELD=VALUE,...]` specs, the first the baseline) and their sizes."""

    runs: tuple[str, ...] = ("h2o", "recall")
    budget: int = 410
    chunk: int = 256
    decode: int = 32  # timed decode tokens per round (one more, untimed, packs the cache first)
    block: int = 8  # decode tokens per turn
    read_block: int = 4096  # read tokens per turn, whole chunks
    rounds: int = 2


def interleaved_read(
    model, ids: list[int], plan: RunsPlan, question: list[int] | None = None
) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    """Stream `ids` (then `question`) into a new cache per run, the caches taking turns in blocks of
    `plan.read_block` tokens (the question ends the last block). Returns {run: (cache, last logits)} and each
    run's (tokens, seconds) per block, the question's tokens counted in the last."""
    tokens = len(ids) + len(question or [])
    # the archive sized to the text, as `h2o stream FILE` sizes it
    caches = {
        spec: H2OCache(
            model,
            CacheSettings.from_spec(spec, budget=plan.budget, chunk=plan.chunk),
            span=tokens + plan.decode + 1,
        )
        for spec in plan.runs
    }
    blocks = [[ids[start : start + plan.read_block]] for start in range(0, len(ids), plan.read_block)]
    if question:
        blocks[-1].append(NewChunk(question))
    logits, speeds = {}, {spec: [] for spec in plan.runs}
    for pieces in blocks:
        for spec, cache in caches.items():
            started = time.perf_counter()
            logits[spec], stats = prefill(model, cache, pieces, plan.chunk)
            stats.reraise()
            speeds[spec].append((sum(map(len, pieces)), time.perf_counter() - started))
    return {spec: (cache, logits[spec]) for spec, cache in caches.items()}, speeds


def interleaved_decode(model, states: dict, decode: int, block: int) -> dict[str, list[tuple[int, float]]]:
    """Greedy-decode `decode` tokens from every (cache, logits) state, the states taking turns in blocks of
    `block` tokens. Returns each state's (tokens, seconds) per block; the first token, which packs the cache
    after the read, is decoded untimed."""
    steps = {name: generate_ids(model, cache, logits, Sampling(max_new_tokens=decode + 1))
             for name, (cache, logits) in states.items()}  # fmt: skip
    for step in steps.values():
        next(step)
    blocks: dict[str, list[tuple[int, float]]] = {name: [] for name in steps}
    for start in range(0, decode, block):
        size = min(block, decode - start)
        for name, step in steps.items():
            started = time.perf_counter()
            for _ in range(size):
                next(step)
            blocks[name].append((size, time.perf_counter() - started))
    return blocks


def quartiles(values: list[float]) -> tuple[float, float]:
    """(first, third) quartile; one value is both."""
    if len(values) < 2:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4)
    return low, high


def summary(reads: dict[str, list], decodes: dict[str, list], runs: tuple[str, ...]) -> list[dict]:
    """One row per run from its (tokens, seconds) blocks: read tokens/s (all tokens over all time) and its ratio
    to the first run's, decode tokens/s (median of the blocks) and the median of the per-block ratios."""
    base = runs[0]

    def rate(blocks):
        return sum(tokens for tokens, _ in blocks) / sum(seconds for _, seconds in blocks)

    rows = []
    for spec in runs:
        read_pairs = [old[1] / new[1] for new, old in zip(reads[spec], reads[base], strict=True)]
        speeds = [tokens / seconds for tokens, seconds in decodes[spec]]
        base_speeds = [tokens / seconds for tokens, seconds in decodes[base]]
        pairs = [new / old for new, old in zip(speeds, base_speeds, strict=True)]
        rows.append({
            "run": spec,
            "read_tokens": sum(tokens for tokens, _ in reads[spec]), "read_tok_s": rate(reads[spec]),
            "read_ratio": rate(reads[spec]) / rate(reads[base]), "read_iqr": quartiles(read_pairs),
            "decode_tokens": sum(tokens for tokens, _ in decodes[spec]),
            "decode_tok_s": statistics.median(speeds), "decode_ratio": statistics.median(pairs),
            "decode_iqr": quartiles(pairs), "read_blocks": reads[spec], "decode_blocks": decodes[spec],
        })  # fmt: skip
    return rows


def measure(
    model,
    ids: list[int],
    plan: RunsPlan,
    question: list[int] | None = None,
    progress: Callable[[str], None] = print,
) -> list[dict]:
    """`plan.rounds` rounds of every run over `ids` (then `question`): `summary`'s rows."""
    reads: dict[str, list] = {spec: [] for spec in plan.runs}
    decodes: dict[str, list] = {spec: [] for spec in plan.runs}
    for number in range(plan.rounds):
        progress(f"round {number + 1}: {', '.join(plan.runs)} read {len(ids)} tokens in turns, then decode")
        states, speeds = interleaved_read(model, ids, plan, question)
        for spec in plan.runs:
            reads[spec].extend(speeds[spec])
        for spec, blocks in interleaved_decode(model, states, plan.decode, plan.block).items():
            decodes[spec].extend(blocks)
        del states
    return summary(reads, decodes, plan.runs)


def markdown(rows: list[dict], context: int, budget: int, chunk: int) -> list[str]:
    """One context's table (lines of markdown)."""
    base = rows[0]["run"]
    lines = [
        f"Context {context:,}, budget {budget}: reads are all tokens over all their time, with the per-block "
        "ratios' interquartile range; decode is the median over blocks, and of the per-block ratios.",
        "",
        f"| run | read tok/s (chunk {chunk}) | vs {base} (IQR of blocks) | decode tok/s | vs {base} (IQR) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        (read_low, read_high), (low, high) = row["read_iqr"], row["decode_iqr"]
        lines.append(f"| {row['run']} | {row['read_tok_s']:.1f} | {row['read_ratio']:.2f}× "
                     f"({read_low:.2f}-{read_high:.2f}) | {row['decode_tok_s']:.2f} | {row['decode_ratio']:.2f}× "
                     f"({low:.2f}-{high:.2f}) |")  # fmt: skip
    return lines
