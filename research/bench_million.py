"""Stream a million tokens through one cache in one process: ms/token and RSS every `--every` tokens.

A book is repeated until the stream is long enough (War and Peace, ~0.8M tokens a copy, by default). Every
`--every` tokens one JSON line goes to `--log` as it is measured (so a stopped run keeps what it measured);
at the end the table and a plot are written.

    nice python research/bench_million.py --tokens 1000000 --log docs/results/million.jsonl \
        --plot docs/figs/million.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from itertools import repeat
from pathlib import Path

import psutil
import torch

from h2o_cli.cache import H2OCache
from h2o_cli.models import load_model
from h2o_cli.runtime import make_settings, peak_rss_bytes
from h2o_cli.streaming import stream_perplexity
from h2o_cli.textio import text_blocks, token_stream

BOOK = Path("gutenberg_books/war_and_peace_pg2600.txt")  # under the data folder ($H2O_DATA)


def book_pieces(tokenizer, book: Path):
    """Token ids of the book, over and over (each copy tokenized as the file would be)."""
    for _ in repeat(None):
        with book.open("rb") as handle:
            yield from token_stream(tokenizer, text_blocks(handle, name=book.name))


def markdown(rows: list[dict]) -> str:
    first = rows[0]
    lines = [
        "| tokens read | ms/token (window, wall) | CPU ms/token | vs first window (CPU) | RSS MiB "
        "| vs first window | peak RSS MiB | load (1 min) | window PPL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['tokens']:,} | {row['ms_per_token']:.2f} | {row['cpu_ms_per_token']:.2f} "
            f"| {row['cpu_ms_per_token'] / first['cpu_ms_per_token']:.3f} "
            f"| {row['rss_mib']:,.0f} | {row['rss_mib'] / first['rss_mib']:.3f} | {row['peak_rss_mib']:,.0f} "
            f"| {row['load_1min']:.1f} | {row['window_ppl']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [row["tokens"] / 1e3 for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(tokens, [row["ms_per_token"] for row in rows], marker="o", label="wall")
    left.plot(tokens, [row["cpu_ms_per_token"] for row in rows], marker="s", label="CPU")
    left.set(xlabel="tokens read (thousands)", ylabel="ms / token (window)", ylim=(0, None))
    left.legend()
    right.plot(tokens, [row["rss_mib"] for row in rows], marker="o", label="RSS")
    right.plot(tokens, [row["peak_rss_mib"] for row in rows], linestyle="--", label="peak RSS")
    right.set(xlabel="tokens read (thousands)", ylabel="MiB", ylim=(0, None))
    right.legend()
    figure.suptitle(rows[0]["title"])
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--book", type=Path, default=None, help="default: War and Peace under $H2O_DATA")
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=100_000)
    parser.add_argument("--budget", default="0.1")
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--log", type=Path, required=True, help="JSON lines, one per window, written as measured"
    )
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    if args.book is None:
        from h2o_cli.eval.data import data_dir

        args.book = data_dir() / BOOK

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    settings = make_settings(model, args.budget, policy=args.policy, chunk=args.chunk)
    cache = H2OCache(model, settings)
    process = psutil.Process()
    title = (
        f"{args.model}, {args.policy} budget {settings.budget} tokens, chunk {args.chunk}, "
        f"{args.threads} thread(s), {platform.processor() or platform.machine()}"
    )
    args.log.parent.mkdir(parents=True, exist_ok=True)
    log = args.log.open("w")
    window = {
        "tokens": 0,
        "nll": 0.0,
        "predictions": 0,
        "clock": time.perf_counter(),
        "cpu": _cpu_seconds(process),
    }
    rows: list[dict] = []

    def on_chunk(stats) -> None:
        if stats.tokens - window["tokens"] < args.every and stats.tokens < args.tokens:
            return
        now = time.perf_counter()
        read = stats.tokens - window["tokens"]
        predictions = stats.predictions - window["predictions"]
        row = {
            "title": title,
            "tokens": stats.tokens,
            "ms_per_token": 1000 * (now - window["clock"]) / read,
            # CPU time of this process per token: the cost itself, less sensitive to other load than wall time.
            "cpu_ms_per_token": 1000 * (_cpu_seconds(process) - window["cpu"]) / read,
            "load_1min": os.getloadavg()[0],
            "rss_mib": process.memory_info().rss / 2**20,
            "peak_rss_mib": peak_rss_bytes() / 2**20,
            "window_ppl": float(torch.tensor((stats.nll - window["nll"]) / max(predictions, 1)).exp()),
            "cache_mib": cache.nbytes() / 2**20,
            "cached_tokens": cache.length,
            "evictions_per_head": cache.report().evictions,
        }
        rows.append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()
        window.update(
            tokens=stats.tokens,
            nll=stats.nll,
            predictions=stats.predictions,
            clock=time.perf_counter(),
            cpu=_cpu_seconds(process),
        )

    stats = stream_perplexity(
        model, cache, book_pieces(tokenizer, args.book), args.chunk, args.tokens, on_chunk
    )
    log.close()
    print(markdown(rows))
    print(f"\n{stats.tokens:,} tokens in {stats.seconds / 3600:.2f} h, whole-stream PPL {stats.ppl:.3f}")
    if args.plot is not None and rows:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
