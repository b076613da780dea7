"""What `recall` costs against `h2o` at the same budget (decode and stream tokens/s).

One process, one model; rounds alternate the policies, so both see the same machine load. Per round: each
policy streams `--context` tokens of a book through its own cache in chunks (tokens/s of that read); then every
cache greedy-decodes `--decode` tokens, the policies taking turns in blocks of `--block` tokens (each block
timed), so slow drifts of a shared machine fall on all of them alike. Prints a markdown table: read tokens/s
(median over rounds), decode tokens/s (median over blocks), and each against the first run — for decode the
median of the per-block ratios, with their interquartile range.

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


def read(
    model, ids: list[int], spec: str, budget: int, chunk: int, decode: int, question: list[int] | None = None
) -> tuple[H2OCache, object, float]:
    """Stream `ids` (then `question`, as `h2o stream --prompt` asks one) into a new cache for `spec`. Returns
    the cache, the last logits and the read's tokens/s (the question's tokens counted)."""
    # The archive sized to the text, as `h2o stream FILE` sizes it (in RAM up to 1 GiB, as there)
    pieces = [ids] + ([NewChunk(question)] if question else [])
    tokens = sum(map(len, pieces))
    cache = H2OCache(model, settings_of(spec, budget, chunk), span=tokens + decode)
    started = time.perf_counter()
    logits, stats = prefill(model, cache, pieces, chunk)
    stats.reraise()
    return cache, logits, tokens / (time.perf_counter() - started)


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
    reads: dict[str, list[float]] = {spec: [] for spec in args.runs}
    decodes: dict[str, list[float]] = {spec: [] for spec in args.runs}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        states = {}
        for spec in args.runs:
            cache, logits, speed = read(model, ids, spec, args.budget, args.chunk, args.decode + 1, question)
            states[spec] = (cache, logits)
            reads[spec].append(speed)
        for spec, speeds in interleaved_decode(model, states, args.decode, args.block).items():
            decodes[spec].extend(speeds)
        del states
    base = args.runs[0]
    print(f"`python scripts/bench_recall.py --context {args.context} --budget {args.budget} --chunk {args.chunk} "
          f"--decode {args.decode} --block {args.block} --rounds {args.rounds} --threads {args.threads} "
          f"--runs {' '.join(args.runs)}" + (f" --question {args.question!r}" if args.question else "") + f"` — {platform.processor() or platform.machine()}, torch threads "
          f"{args.threads}, load average {load:.1f} at the start; reads: median over rounds; decode: median over "
          "blocks, and of the per-block ratios (interquartile range)\n")  # fmt: skip
    print(f"| run | read tok/s (chunk {args.chunk}) | vs {base} | decode tok/s | vs {base} |")
    print("|---|---|---|---|---|")
    for spec in args.runs:
        read_speed = statistics.median(reads[spec])
        ratio = statistics.median(reads[spec]) / statistics.median(reads[base])
        pairs = [new / old for new, old in zip(decodes[spec], decodes[base], strict=True)]
        low, _, high = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (pairs[0],) * 3
        print(f"| {spec} | {read_speed:.1f} | {ratio:.2f}x | {statistics.median(decodes[spec]):.2f} | "
              f"{statistics.median(pairs):.2f}x ({low:.2f}-{high:.2f}) |")  # fmt: skip


if __name__ == "__main__":
    main()
