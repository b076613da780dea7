"""Measure `h2o stream --ppl`: tokens/s and peak RSS per policy, chunk and length; write docs/benchmarks.md.

Each run is a fresh `h2o stream --json` process, so its peak RSS is its own. A book shorter than the
requested length is repeated (cat-ed several times) through stdin.

    python research/bench_stream.py --lengths 10000,100000 --chunks 1,256 --out docs/benchmarks.md
    python research/bench_stream.py --sweep 32,64,128,256,512 --lengths 4000    # choose the default --chunk
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

BOOK = Path("gutenberg_books/war_and_peace_pg2600.txt")  # under the data folder ($H2O_DATA)
BEGIN, END = "<!-- stream:begin -->", "<!-- stream:end -->"


def run(policy: str, chunk: int, tokens: int, budget: str, threads: int, book: Path) -> dict:
    """One `h2o stream - --ppl --json` over the book repeated enough times to give `tokens` tokens."""
    repeats = max(1, -(-tokens * 5 // book.stat().st_size) + 1)  # ~4-5 bytes per token, with room to spare
    text = book.read_bytes() * repeats
    command = [sys.executable, "-c", "from h2o_cli.cli.app import main; main()", "stream", "-", "--ppl", "--json",
               "--policy", policy, "--budget", budget, "--chunk", str(chunk), "--max-tokens", str(tokens),
               "--threads", str(threads)]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(
        command, input=text, capture_output=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    )
    if done.returncode != 0:
        return {
            "policy": policy,
            "chunk": chunk,
            "tokens": tokens,
            "error": done.stderr.decode().strip()[-200:],
        }
    report = json.loads(done.stdout)
    report["wall_s"] = time.perf_counter() - started
    return report


def table(rows: list[dict]) -> str:
    lines = [
        "| policy | budget (tokens) | chunk | tokens | tokens/s | ppl | KV cache MiB | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['policy']} | | {r['chunk']} | {r['tokens']:,} | failed: {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['policy']} | {r['budget_tokens']} | {r['chunk']} | {r['tokens']:,} | {r['tokens_per_s']:.1f} "
            f"| {r['ppl']:.3f} | {r['kv_cache_bytes'] / 2**20:.1f} | {r['peak_rss_bytes'] / 2**20:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policies", default="full,local,sink,h2o")
    parser.add_argument("--lengths", default="10000,100000")
    parser.add_argument("--chunks", default="1,256")
    parser.add_argument("--sweep", default=None, help="chunk sizes to compare (h2o only)")
    parser.add_argument("--budget", default="0.1")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-chunk1-tokens", type=int, default=10000, help="cap for token-by-token runs")
    parser.add_argument("--book", type=Path, default=None, help="default: War and Peace under $H2O_DATA")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.book is None:
        from h2o_cli.eval.data import data_dir

        args.book = data_dir() / BOOK
    rows = []
    load = os.getloadavg()[0]
    if args.sweep:
        plan = [("h2o", int(c), int(n)) for n in args.lengths.split(",") for c in args.sweep.split(",")]
    else:
        plan = []
        for n in map(int, args.lengths.split(",")):
            for chunk in map(int, args.chunks.split(",")):
                for policy in args.policies.split(","):
                    tokens = min(n, args.max_chunk1_tokens) if chunk == 1 else n
                    if policy == "full":
                        tokens = min(tokens, 8192 - 256)  # full attention stops at the context window
                    if (policy, chunk, tokens) not in [(p, c, t) for p, c, t in plan]:
                        plan.append((policy, chunk, tokens))
    for policy, chunk, tokens in plan:
        row = run(policy, chunk, tokens, args.budget, args.threads, args.book)
        rows.append(row)
        print(
            json.dumps(
                {
                    k: row.get(k)
                    for k in ("policy", "chunk", "tokens", "tokens_per_s", "ppl", "peak_rss_bytes", "error")
                }
            ),
            flush=True,
        )
    header = (
        f"Measured by `python research/bench_stream.py {' '.join(sys.argv[1:])}` on {time.strftime('%Y-%m-%d')}: "
        f"{args.book.name}, budget {args.budget}, torch threads {args.threads}, OMP_WAIT_POLICY=PASSIVE, "
        f"load average {load:.1f} at the start (other processes shared the 2 cores when it is above ~1)."
    )
    text = header + "\n\n" + table(rows)
    print(text)
    if args.out:
        doc = args.out.read_text() if args.out.exists() else ""
        block = f"{BEGIN}\n{text}\n{END}"
        doc = (
            re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
            if BEGIN in doc
            else doc.rstrip() + "\n\n" + block + "\n"
        )
        args.out.write_text(doc)


if __name__ == "__main__":
    main()
