"""`h2o stream --ppl` as a user runs it: tokens/s, perplexity, KV cache and peak RSS per policy, chunk and
length. Each run is a fresh `h2o stream - --ppl --json` process reading a book from stdin (repeated when a run
needs more tokens than the book has), so its peak RSS is its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from h2o_cli.policies import policy_class


@dataclass(frozen=True)
class StreamsPlan:
    """Which streams: every policy at every length and chunk. Token-by-token runs (chunk 1) read at most
    `chunk1_tokens`; `full` stops at the context window (`window` tokens, less one chunk)."""

    policies: tuple[str, ...] = ("full", "local", "sink", "h2o")
    lengths: tuple[int, ...] = (10_000, 100_000)
    chunks: tuple[int, ...] = (1, 256)
    budget: str = "0.1"
    chunk1_tokens: int = 10_000
    window: int = 8192
    dtype: str = "auto"  # each run's `--dtype`

    def runs(self) -> list[tuple[str, int, int]]:
        """(policy, chunk, tokens) of each run, in order, without repeats."""
        runs: list[tuple[str, int, int]] = []
        for length in self.lengths:
            for chunk in self.chunks:
                for policy in self.policies:
                    tokens = min(length, self.chunk1_tokens) if chunk == 1 else length
                    tokens = tokens if policy_class(policy).evicts else min(tokens, self.window - chunk)
                    if (policy, chunk, tokens) not in runs:
                        runs.append((policy, chunk, tokens))
        return runs


def stream_run(
    model: str,
    policy: str,
    chunk: int,
    tokens: int,
    budget: str,
    threads: int,
    book: Path,
    dtype: str = "auto",
) -> dict:
    """One `h2o stream - --ppl --json` over the book, repeated to give `tokens` tokens: its JSON report and its
    wall time, or {"error": the end of its stderr}."""
    repeats = max(1, -(-tokens * 5 // book.stat().st_size) + 1)  # ~4-5 bytes per token, with room to spare
    command = [sys.executable, "-m", "h2o_cli", "stream", "-", "--ppl", "--json", "--model", model,
               "--policy", policy, "--budget", budget, "--chunk", str(chunk), "--max-tokens", str(tokens),
               "--threads", str(threads), "--dtype", dtype]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(
        command, input=book.read_bytes() * repeats, capture_output=True,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )  # fmt: skip
    row = {"policy": policy, "chunk": chunk, "asked": tokens}
    if done.returncode != 0:
        return {**row, "error": done.stderr.decode(errors="replace").strip()[-200:]}
    import json

    return {**row, **json.loads(done.stdout), "wall_s": time.perf_counter() - started}


def measure(
    plan: StreamsPlan, model: str, book: Path, threads: int, progress: Callable[[str], None] = print
) -> list[dict]:
    """`stream_run` for each of `plan.runs()`."""
    rows = []
    for policy, chunk, tokens in plan.runs():
        progress(f"h2o stream --policy {policy} --chunk {chunk}: {tokens} tokens")
        rows.append(stream_run(model, policy, chunk, tokens, plan.budget, threads, book, plan.dtype))
    return rows


def markdown(rows: list[dict], plan: StreamsPlan) -> list[str]:
    """The table (lines of markdown)."""
    lines = [
        f"Each row a fresh `h2o stream - --ppl --json` process (budget {plan.budget}), its peak RSS its own.",
        "",
        "| policy | budget (tokens) | chunk | tokens | tokens/s | ppl | KV cache MiB | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['policy']} | | {r['chunk']} | {r['asked']:,} | failed: {r['error']} | | | |")
            continue
        lines.append(f"| {r['policy']} | {r['budget_tokens']} | {r['chunk']} | {r['tokens']:,} | "
                     f"{r['tokens_per_s']:.1f} | {r['ppl']:.3f} | {r['kv_cache_bytes'] / 2**20:.1f} | "
                     f"{r['peak_rss_bytes'] / 2**20:,.0f} |")  # fmt: skip
    return lines
