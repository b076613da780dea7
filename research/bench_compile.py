"""Decode tokens/s of `--compile` (the captured fixed step, h2o_cli.compiled) against the default path (the C
step on a CPU) and the fixed step run eagerly, at one context and budget.

One process, one model. Each run reads `--context` tokens of the shipped sample text into a fresh cache (chunks
of 256), then greedy-decodes: `--warmup` tokens untimed (the compilation happens there), then `--decode` timed.
Rounds alternate the runs so they see the same machine load. Prints a markdown table and the compile time.

    python research/bench_compile.py --context 1024 --budget 102 --decode 64 --rounds 2 --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from h2o_cli.cache import H2OCache
from h2o_cli.compiled import CompiledStep
from h2o_cli.config import CacheSettings
from h2o_cli.data import SAMPLE_TEXT
from h2o_cli.generation import Sampling, generate_ids
from h2o_cli.models import load_model
from h2o_cli.streaming import prefill

RUNS = ("default", "fixed-eager", "compile")


def one_round(model, ids: list[int], run: str, args) -> tuple[float, float]:
    """(decode tokens/s, seconds of the untimed warm-up) of one run."""
    cache = H2OCache(model, CacheSettings(budget=args.budget, chunk=256, policy=args.policy))
    logits, stats = prefill(model, cache, [ids], 256)
    stats.reraise()
    step = None if run == "default" else CompiledStep(model, cache, compile=run == "compile")
    tokens = generate_ids(model, cache, logits, Sampling(max_new_tokens=args.warmup + args.decode), step=step)
    started = time.perf_counter()
    for _ in range(args.warmup):
        next(tokens)
    warmup = time.perf_counter() - started
    started = time.perf_counter()
    for _ in tokens:
        pass
    return args.decode / (time.perf_counter() - started), warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=102)
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    ids = tokenizer(SAMPLE_TEXT.read_text(encoding="utf-8"))["input_ids"][: args.context]
    figures: dict[str, list[tuple[float, float]]] = {run: [] for run in args.runs}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for run in args.runs:
            figures[run].append(one_round(model, ids, run, args))
    load = max(load, os.getloadavg()[0])
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"load {load:.1f}, context {len(ids)}, budget {args.budget}, policy {args.policy}")  # fmt: skip
    base = statistics.median(rate for rate, _ in figures[args.runs[0]])
    print("| run | decode tok/s (median) | rounds | vs " + args.runs[0] + " | warm-up s (first round) |")
    print("|---|---|---|---|---|")
    for run, rows in figures.items():
        rate = statistics.median(r for r, _ in rows)
        rounds = ", ".join(f"{r:.2f}" for r, _ in rows)
        print(f"| {run} | {rate:.2f} | {rounds} | {rate / base:.2f}× | {rows[0][1]:.1f} |")


if __name__ == "__main__":
    main()
