"""Is one checkout's decode as fast as another's? A paired measurement that survives a noisy machine.

    python scripts/paired_decode.py --old ../h2o-before --new . --contexts 1024,4096,8000 --rounds 24

Starts one worker process per checkout (each imports its own tree: PYTHONPATH=<tree>:<tree>/kernels), both on
the same model, book, context and budget. Each worker reads `context` tokens once, then the coordinator asks
them in turn (ABBA order) for blocks of `--block` greedy-fed decode tokens (the book's next tokens, as
`h2o bench --only speed` does). One round = one block of each; the round's ratio is new/old tokens/s. The two
blocks of a round run seconds apart, so slow drifts of the machine (other tenants, clock) cancel in the ratio;
the median over rounds and its interquartile range are printed, with the plain tokens/s of both sides.
Both workers stay alive for the whole context; only one runs at a time (the other waits on a pipe).
Uses only the public API both trees share (load_model, H2OCache, CacheSettings).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import sys, time, torch, h2o_cli
from h2o_cli import H2OCache, CacheSettings
from h2o_cli.models import load_model
model_name, book, context, budget, chunk, threads = sys.argv[1:7]
context, budget, chunk = int(context), int(budget), int(chunk)
torch.set_num_threads(int(threads))
model, tokenizer = load_model(model_name)
ids = tokenizer(open(book, encoding="utf-8").read())["input_ids"]
ids = (ids * (1_000_000 // len(ids) + 1))
cache = H2OCache(model, CacheSettings(budget=budget, policy="h2o", chunk=chunk))
with torch.inference_mode():
    for start in range(0, context, chunk):
        model(torch.tensor([ids[start:min(start + chunk, context)]]), cache=cache, use_cache=True)
    at = context
    print("ready", h2o_cli.__file__, flush=True)
    for line in sys.stdin:
        n = int(line)
        started = time.perf_counter()
        for token in ids[at:at + n]:
            model(torch.tensor([[token]]), cache=cache, use_cache=True)
        at += n
        print(n / (time.perf_counter() - started), flush=True)
"""


def start_worker(tree: Path, args, context: int) -> subprocess.Popen:
    env = dict(
        os.environ, PYTHONPATH=f"{tree}:{tree / 'kernels'}", OMP_WAIT_POLICY="PASSIVE", TQDM_DISABLE="1"
    )
    budget = max(1, round(args.budget * context))
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WORKER,
            args.model,
            str(args.book.resolve()),
            str(context),
            str(budget),
            str(args.chunk),
            "1",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tree,  # `python -c` puts the working directory first on sys.path
    )
    ready = worker.stdout.readline().split()
    if ready[:1] != ["ready"]:
        raise SystemExit(f"worker for {tree} failed to start (run it by hand to see why)")
    if not ready[1].startswith(str(tree)):
        raise SystemExit(f"worker for {tree} imported {ready[1]}: another h2o_cli wins on sys.path")
    return worker


def block(worker: subprocess.Popen, tokens: int) -> float:
    worker.stdin.write(f"{tokens}\n")
    worker.stdin.flush()
    return float(worker.stdout.readline())


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="checkout measured as the baseline")
    parser.add_argument("--new", type=Path, default=Path("."), help="checkout measured against it")
    parser.add_argument("--contexts", default="1024,4096,8000")
    parser.add_argument("--budget", type=float, default=0.1, help="fraction of the context kept")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--block", type=int, default=24, help="decode tokens per block")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--book", type=Path, default=Path(__file__).parents[1] / "h2o_cli/data/frankenstein_pg84.txt"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    results = []
    for context in (int(c) for c in args.contexts.split(",")):
        workers = {"old": start_worker(args.old.resolve(), args, context)}
        workers["new"] = start_worker(args.new.resolve(), args, context)
        block(workers["old"], 4), block(workers["new"], 4)  # warm both once
        speed = {"old": [], "new": []}
        for round_ in range(args.rounds):
            order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
            for side in order:
                speed[side].append(block(workers[side], args.block))
        for worker in workers.values():
            worker.stdin.close()
            worker.wait()
        ratios = [n / o for n, o in zip(speed["new"], speed["old"], strict=True)]
        q1, median, q3 = quartiles(ratios)
        row = {
            "context": context,
            "old_tok_s": statistics.median(speed["old"]),
            "new_tok_s": statistics.median(speed["new"]),
            "ratio_median": median,
            "ratio_q1": q1,
            "ratio_q3": q3,
            "rounds": args.rounds,
            "block": args.block,
        }
        results.append(row)
        if not args.json:
            print(
                f"{context:>6} tokens: old {row['old_tok_s']:.2f} tok/s, new {row['new_tok_s']:.2f} tok/s, "
                f"new/old median {median:.3f} (IQR {q1:.3f}-{q3:.3f}, {args.rounds} rounds of {args.block})",
                flush=True,
            )
    if args.json:
        print(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M"), "rows": results}))


if __name__ == "__main__":
    main()
