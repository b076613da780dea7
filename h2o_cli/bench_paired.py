"""Is one checkout's decode as fast as another's? A paired measurement that survives a noisy machine.

One worker process per checkout (each imports its own tree: PYTHONPATH=<tree>:<tree>/kernels), both on the
same model, book, context and budget. Each worker reads `context` tokens once, then is asked in turn (ABBA
order) for blocks of `block` greedy-fed decode tokens (the book's next tokens). One round = one block of each;
the round's ratio is new/old tokens/s. The two blocks of a round run seconds apart, so slow drifts of the
machine (other tenants, clock) cancel in the ratio. Only one worker runs at a time (the other waits on a pipe).
The worker uses only the public API every tree shares (load_model, H2OCache, CacheSettings), so an older
checkout can be measured too.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from h2o_cli.errors import InputError

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
        print(n, time.perf_counter() - started, flush=True)
"""


@dataclass(frozen=True)
class PairedPlan:
    """Two checkouts (folders holding `h2o_cli/`) on one model and book; `budget` tokens kept of each context."""

    old: Path
    new: Path
    model: str
    book: Path
    rounds: int = 24
    block: int = 24  # decode tokens per block
    chunk: int = 256
    threads: int = 1


class Worker:
    """One checkout's decode loop in its own process, `context` tokens read, waiting for block sizes."""

    def __init__(self, tree: Path, plan: PairedPlan, context: int, budget: int) -> None:
        env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{tree / 'kernels'}", OMP_WAIT_POLICY="PASSIVE",
                   TQDM_DISABLE="1")  # fmt: skip
        arguments = [plan.model, str(plan.book.resolve()), str(context), str(budget), str(plan.chunk),
                     str(plan.threads)]  # fmt: skip
        self.log = tempfile.TemporaryFile("w+")  # its stderr, read back when it fails
        # `python -c` puts the working directory first on sys.path
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, *arguments],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=tree,
        )  # fmt: skip
        ready = self.process.stdout.readline().split()
        if ready[:1] != ["ready"]:
            self.log.seek(0)
            error = self.log.read().strip().splitlines()[-1:] or ["no output"]
            self.close()
            raise InputError(f"the decode worker for {tree} failed to start: {error[0]}")
        if not ready[1].startswith(str(tree)):
            self.close()
            raise InputError(f"the worker for {tree} imported {ready[1]}: another h2o_cli wins on sys.path")

    def block(self, tokens: int) -> tuple[int, float]:
        """Decode `tokens` tokens: (tokens decoded, seconds)."""
        self.process.stdin.write(f"{tokens}\n")
        self.process.stdin.flush()
        count, seconds = self.process.stdout.readline().split()
        return int(count), float(seconds)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()
        self.log.close()


def paired_context(plan: PairedPlan, context: int, budget: int) -> dict:
    """Both checkouts at one context: per-round tokens/s of each side (rounds alternate which goes first), the
    medians and the median of the per-round new/old ratios with its interquartile range."""
    workers = {"old": Worker(plan.old, plan, context, budget)}
    try:
        workers["new"] = Worker(plan.new, plan, context, budget)
        for worker in workers.values():
            worker.block(4)  # warm both once
        blocks: dict[str, list[tuple[int, float]]] = {"old": [], "new": []}
        for number in range(plan.rounds):
            for side in ("old", "new") if number % 2 == 0 else ("new", "old"):
                blocks[side].append(workers[side].block(plan.block))
    finally:
        for worker in workers.values():
            worker.close()
    speeds = {side: [tokens / seconds for tokens, seconds in pairs] for side, pairs in blocks.items()}
    ratios = [new / old for new, old in zip(speeds["new"], speeds["old"], strict=True)]
    low, median, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"context": context, "budget": budget, "rounds": plan.rounds, "block": plan.block,
            "old_tok_s": statistics.median(speeds["old"]), "new_tok_s": statistics.median(speeds["new"]),
            "ratio_median": median, "ratio_q1": low, "ratio_q3": high,
            "old_tokens": sum(tokens for tokens, _ in blocks["old"]),
            "new_tokens": sum(tokens for tokens, _ in blocks["new"]),
            "old_round_tok_s": speeds["old"], "new_round_tok_s": speeds["new"]}  # fmt: skip


def paired_decode(
    plan: PairedPlan, contexts: tuple[int, ...], budgets: list[int], progress: Callable[[str], None] = print
) -> list[dict]:
    """`paired_context` at each context with its budget."""
    rows = []
    for context, budget in zip(contexts, budgets, strict=True):
        progress(f"context {context}: {plan.rounds} rounds of {plan.block} tokens, old and new in turns")
        rows.append(paired_context(plan, context, budget))
    return rows


def markdown(rows: list[dict], plan: PairedPlan) -> list[str]:
    """The paired table (lines of markdown)."""
    lines = [
        f"Old `{plan.old}` vs new `{plan.new}`: h2o decode in blocks of {plan.block} tokens, ABBA order; per "
        "context the median tokens/s of each side and the median new/old ratio of the rounds (interquartile "
        "range).",
        "",
        "| context | budget | old tok/s | new tok/s | new/old (median) | IQR | rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['context']:,} | {row['budget']} | {row['old_tok_s']:.2f} | {row['new_tok_s']:.2f} | "
                     f"**{row['ratio_median']:.3f}** | {row['ratio_q1']:.3f}-{row['ratio_q3']:.3f} | "
                     f"{row['rounds']} |")  # fmt: skip
    return lines
