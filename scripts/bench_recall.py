"""What `recall` costs against `h2o` at the same budget (decode and stream tokens/s).

One process, one model; rounds alternate the policies, so both see the same machine load. Per round and policy:
stream `--context` tokens of a book through the cache in chunks (tokens/s of that read), then greedy-decode
`--decode` tokens (tokens/s). Prints a markdown table with the ratios recall / h2o.

    python scripts/bench_recall.py --context 4096 --budget 410 --decode 32 --rounds 2 --threads 1 \
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
from h2o_cli.streaming import prefill

BOOK = Path("gutenberg_books/war_and_peace_pg2600.txt")


def one_round(model, ids: list[int], spec: str, budget: int, chunk: int, decode: int) -> tuple[float, float]:
    # The archive sized to the text, as `h2o stream FILE` sizes it (in RAM up to 1 GiB, as there)
    cache = H2OCache(model, settings_of(spec, budget, chunk), span=len(ids) + decode)
    started = time.perf_counter()
    logits, stats = prefill(model, cache, [ids], chunk)
    stats.reraise()
    read = len(ids) / (time.perf_counter() - started)
    started = time.perf_counter()
    for _ in generate_ids(model, cache, logits, Sampling(max_new_tokens=decode)):
        pass
    return read, decode / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=410)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", nargs="+", default=["h2o", "recall"])
    parser.add_argument("--book", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    book = args.book or Path(os.environ.get("H2O_DATA", "../shared/data")) / BOOK
    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    ids = tokenizer(book.read_text(encoding="utf-8")[: args.context * 8])["input_ids"][: args.context]
    figures: dict[str, list[tuple[float, float]]] = {spec: [] for spec in args.runs}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for spec in args.runs:
            figures[spec].append(one_round(model, ids, spec, args.budget, args.chunk, args.decode))
    base = args.runs[0]
    base_read = statistics.median(r for r, _ in figures[base])
    base_decode = statistics.median(d for _, d in figures[base])
    print(f"`python scripts/bench_recall.py --context {args.context} --budget {args.budget} --chunk {args.chunk} "
          f"--decode {args.decode} --rounds {args.rounds} --threads {args.threads} --runs {' '.join(args.runs)}` "
          f"— {platform.processor() or platform.machine()}, torch threads {args.threads}, load average {load:.1f} "
          "at the start; medians over rounds\n")  # fmt: skip
    print(f"| run | read tok/s (chunk {args.chunk}) | vs {base} | decode tok/s | vs {base} |")
    print("|---|---|---|---|---|")
    for spec, rows in figures.items():
        read = statistics.median(r for r, _ in rows)
        decode = statistics.median(d for _, d in rows)
        print(
            f"| {spec} | {read:.1f} | {read / base_read:.2f}x | {decode:.2f} | {decode / base_decode:.2f}x |"
        )


if __name__ == "__main__":
    main()
