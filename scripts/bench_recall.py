"""What `recall` costs against `h2o` at the same budget (decode and stream tokens/s).

One process, one model; the policies take turns, so all see the same machine load. Per round: each policy
streams `--context` tokens of a book through its own cache in chunks, the caches taking turns in blocks of
`--read-block` tokens (each block timed); then every cache greedy-decodes `--decode` tokens, taking turns in
blocks of `--block` tokens. So slow drifts of a shared machine fall on all of them alike. Prints a markdown
table: read tokens/s (all tokens over all the read's time), decode tokens/s (median over blocks), and each
against the first run — the read's ratio of the totals with the interquartile range of the per-block ratios,
decode's median of the per-block ratios with theirs.

    python scripts/bench_recall.py --context 4096 --budget 410 --decode 64 --block 8 --rounds 1 --threads 1 \
        --runs h2o recall recall:archive_max=4096
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from recall_grid import settings_of  # scripts/ is on sys.path when run as a script

from h2o_cli.cache import H2OCache
from h2o_cli.generation import Sampling, generate_ids
from h2o_cli.models import load_model
from h2o_cli.prompting import NewChunk
from h2o_cli.streaming import prefill

BOOK = Path("gutenberg_books/war_and_peace_pg2600.txt")


def interleaved_read(
    model,
    ids: list[int],
    specs: list[str],
    budget: int,
    chunk: int,
    decode: int,
    block: int,
    question: list[int] | None = None,
) -> tuple[dict, dict[str, list[float]]]:
    """Stream `ids` (then `question`, as `h2o stream --prompt` asks one) into a new cache for each spec, the
    caches taking turns in blocks of `block` tokens (a multiple of `chunk`, so each cache reads the chunks one
    read would; the question ends the last block). Returns {spec: (cache, last logits)} and each spec's
    (tokens, seconds) per block (the question's tokens counted in the last)."""
    assert block % chunk == 0, "a block is whole chunks"
    tokens = len(ids) + len(question or [])
    # The archive sized to the text, as `h2o stream FILE` sizes it (in RAM up to 1 GiB, as there)
    caches = {spec: H2OCache(model, settings_of(spec, budget, chunk), span=tokens + decode) for spec in specs}
    blocks = [[ids[start : start + block]] for start in range(0, len(ids), block)]
    if question:
        blocks[-1].append(NewChunk(question))
    logits, speeds = {}, {spec: [] for spec in specs}
    for pieces in blocks:
        for spec, cache in caches.items():
            started = time.perf_counter()
            logits[spec], stats = prefill(model, cache, pieces, chunk)
            stats.reraise()
            speeds[spec].append((sum(map(len, pieces)), time.perf_counter() - started))
    return {spec: (cache, logits[spec]) for spec, cache in caches.items()}, speeds


def interleaved_decode(model, states: dict, decode: int, block: int) -> dict[str, list[float]]:
    """Greedy-decode `decode` tokens from every (cache, logits) state, the states taking turns in blocks of
    `block` tokens. Returns each state's tokens/s per block (the first token, which packs the cache, untimed)."""
    steps = {name: generate_ids(model, cache, logits, Sampling(max_new_tokens=decode + 1))
             for name, (cache, logits) in states.items()}  # fmt: skip
    for step in steps.values():
        next(step)
    speeds: dict[str, list[float]] = {name: [] for name in steps}
    for start in range(0, decode, block):
        size = min(block, decode - start)
        for name, step in steps.items():
            started = time.perf_counter()
            for _ in range(size):
                next(step)
            speeds[name].append(size / (time.perf_counter() - started))
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=410)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--block", type=int, default=8, help="decode tokens per turn of each policy")
    parser.add_argument("--read-block", type=int, default=4096, help="read tokens per turn (whole chunks)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", nargs="+", default=["h2o", "recall"])
    parser.add_argument("--book", type=Path, default=None)
    parser.add_argument(
        "--question",
        default=None,
        help="end the read with this question, as `h2o stream --prompt` asks one (a recall lead head then answers)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    book = args.book or Path(os.environ.get("H2O_DATA", "../shared/data")) / BOOK
    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    ids = tokenizer(book.read_text(encoding="utf-8")[: args.context * 8])["input_ids"][: args.context]
    question = tokenizer(args.question, add_special_tokens=False)["input_ids"] if args.question else None
    reads: dict[str, list[tuple[int, float]]] = {spec: [] for spec in args.runs}
    decodes: dict[str, list[float]] = {spec: [] for spec in args.runs}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        states, speeds = interleaved_read(
            model, ids, args.runs, args.budget, args.chunk, args.decode + 1, args.read_block, question
        )
        for spec in args.runs:
            reads[spec].extend(speeds[spec])
        for spec, speeds in interleaved_decode(model, states, args.decode, args.block).items():
            decodes[spec].extend(speeds)
        del states
    base = args.runs[0]
    print(f"`python scripts/bench_recall.py --context {args.context} --budget {args.budget} --chunk {args.chunk} "
          f"--decode {args.decode} --block {args.block} --read-block {args.read_block} --rounds {args.rounds} --threads {args.threads} "
          f"--runs {' '.join(args.runs)}" + (f" --question {args.question!r}" if args.question else "") + f"` — {platform.processor() or platform.machine()}, torch threads "
          f"{args.threads}, load average {load:.1f} at the start; reads: all tokens over all their time, with "
          "the per-block ratios' interquartile range; decode: median over blocks, and of the per-block ratios "
          "(interquartile range)\n")  # fmt: skip
    print(f"| run | read tok/s (chunk {args.chunk}) | vs {base} (IQR of blocks) | decode tok/s | vs {base} |")
    print("|---|---|---|---|---|")

    def speed(blocks):
        return sum(tokens for tokens, _ in blocks) / sum(seconds for _, seconds in blocks)

    def quartiles(pairs: list[float]) -> str:
        low, _, high = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (pairs[0],) * 3
        return f"({low:.2f}-{high:.2f})"

    for spec in args.runs:
        read_pairs = [old[1] / new[1] for new, old in zip(reads[spec], reads[base], strict=True)]
        pairs = [new / old for new, old in zip(decodes[spec], decodes[base], strict=True)]
        print(f"| {spec} | {speed(reads[spec]):.1f} | {speed(reads[spec]) / speed(reads[base]):.2f}x "
              f"{quartiles(read_pairs)} | {statistics.median(decodes[spec]):.2f} | "
              f"{statistics.median(pairs):.2f}x {quartiles(pairs)} |")  # fmt: skip


if __name__ == "__main__":
    main()
