"""What recall's page choice costs per decode step as the archive grows (the curve docs/benchmarks.md states).

One `PageArchive` per size, filled with random keys (the choice's cost does not depend on their values), the
embedded model's shape (3 KV heads of 64, 3 query heads each) and the default choice (attention mass inside a
shortlist of 512 pages of 16, blocks of 4, carried scores). Per size: the median time of `step_bounds` (what a
one-token step ranks pages by: the mass over the 512 pages its carried scores rank best, their keys kept from
the step before), by torch and, where a C compiler is found, as the C step computes it (`StepScores`: one
call, the shortlist's keys held there); what a chunk's choice takes in its two parts, picking the shortlist (sections of 256 tokens,
then the blocks of the best sections: `PageArchive.shortlisted`) and the attention mass over those pages'
keys (read from the archive); what bounding every block would cost (the flat bound, linear in the archive);
and a question's choice, once per question: the mass of `--question` tokens' queries over every page; and the
rest of a C step's choice (archive.c's `archive_choose`: which pages hold a candidate, the best of them by the
scores, the read into 410 recall slots, with 410 resident tokens, all of them the newest). Per layer, and the
step for all 30 layers. One thread. The C scores are timed twice: one layer's call repeated (its held keys stay
in the CPU's caches) and 30 layers' calls in turn (`--layers`; each holds its own keys, as a decode step reads
30 layers' worth, the per-layer median of the sweeps): the second is what a step pays. The every-block bound,
the shortlist and its mass are taken under `--choosing` tokens' queries (1, a step's, by default; 32 for what a
256-token chunk of text chooses with, `--choice-tokens`).

    python research/bench_choice.py --tokens 8192,32768,131072 --repeat 30
    python research/bench_choice.py --tokens 32768,131072 --choosing 32 --repeat 10
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import time

import torch
from h2o_kernels import native, native_archive

from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.cache.recall.c_step import StepScores

LAYERS, N_KV, GROUP, HEAD_DIM = 30, 3, 3, 64


def median_ms(run, repeat: int) -> float:
    run()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def c_choose(archive: PageArchive, recall: int = 410, resident: int = 410):
    """A callable running `native_archive.archive_choose` on `archive` (every page scored at random), with `resident`
    tokens in S (the newest) and `recall` slots, as the C step calls it (h2o_cli.cache.recall.c_step)."""
    tokens, pages, capacity = archive.tokens, archive.span // 16, archive.capacity
    index = torch.arange(tokens - resident, tokens).expand(N_KV, -1).contiguous()
    valid = torch.ones(N_KV, resident, dtype=torch.bool)
    slots = (torch.zeros(N_KV, recall, HEAD_DIM), torch.zeros(N_KV, recall, HEAD_DIM),
             torch.full((N_KV, recall), -1, dtype=torch.int64))  # fmt: skip
    scratch = (torch.zeros(capacity, dtype=torch.uint8), torch.full((capacity,), -1, dtype=torch.int64),
               torch.empty(archive.pages, 2, dtype=torch.int64), torch.empty(recall, dtype=torch.int64),
               torch.empty(2, recall, HEAD_DIM), torch.zeros(2, archive.pages, dtype=torch.int64))  # fmt: skip
    counts, totals, bound = (
        torch.zeros(N_KV, dtype=torch.int64),
        (ctypes.c_int64 * 2)(),
        torch.rand(N_KV, pages),
    )
    held = (index, valid, *slots, *scratch, counts, bound)  # kept alive with the callable

    def run() -> None:
        native_archive.archive_choose(
            bound, HEAD_DIM, (index.data_ptr(), valid.data_ptr()), resident, resident, tokens - 1, capacity, 16,
            tuple(t.data_ptr() for t in (archive.token_index, archive.keys, archive.values)), recall,
            tuple(t.data_ptr() for t in slots), tuple(t.data_ptr() for t in scratch), counts, totals,
        )  # fmt: skip
        assert held

    return run


def product_times(tokens: int, choosing: int, shortlist: int, repeat: int) -> str:
    """The chunk choice's two matrix products at `tokens` archived tokens, float32 against bfloat16 (what a
    half-precision choice would cost where the CPU multiplies bfloat16 fast, e.g. AMX): the flat bound's
    summaries [n_kv, blocks of 4, 2 * d] x queries, and the shortlist's keys x queries."""
    m = GROUP * choosing
    shapes = {"bound": ((N_KV, tokens // 4, 2 * HEAD_DIM), (N_KV, 2 * HEAD_DIM, m)),
              "mass": ((N_KV, m, HEAD_DIM), (N_KV, HEAD_DIM, shortlist * 16))}  # fmt: skip
    cells = []
    for name, (left, right) in shapes.items():
        times = []
        for kind in (torch.float32, torch.bfloat16):  # the operands converted before the clock starts
            a, b = torch.randn(left).to(kind), torch.randn(right).to(kind)
            times.append(median_ms(lambda a=a, b=b: torch.bmm(a, b), repeat))
        cells.append(f"{name} product {times[0]:.2f} ms float32, {times[1]:.2f} ms bfloat16")
    return f"{tokens:,} tokens, {m} queries per KV head: " + "; ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 131072]
    )
    parser.add_argument("--shortlist", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--question", type=int, default=20, help="tokens of a question (its queries score)")
    parser.add_argument(
        "--choosing", type=int, default=1,
        help="tokens whose queries pick the shortlist and score its mass (1: a step; 32: a chunk of text's)",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, default=30, help="layers whose C scores are timed in turn")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{platform.machine()}, {platform.processor() or 'cpu'}, torch threads 1, load average "
          f"{os.getloadavg()[0]:.1f} at the start; medians of {args.repeat} steps, one layer; bound, shortlist "
          f"and mass under {args.choosing} token(s)' queries\n")  # fmt: skip
    print("| archive tokens | pages | every block bounded (ms) | shortlist picked (ms) | shortlist mass (ms) "
          "| step choice, torch (ms) | step choice, C (ms) | C, layers in turn (ms per layer) | C × 30 layers (ms) "
          "| question, every page (ms) "
          "| C choose (ms) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        pages_settings = PageSettings(16, attention=True, shortlist=args.shortlist, carry=0.9)
        archive = PageArchive(N_KV, HEAD_DIM, tokens, pages_settings, torch.float32, torch.device("cpu"))
        archive.write(torch.randn(N_KV, tokens, HEAD_DIM), torch.randn(N_KV, tokens, HEAD_DIM))
        query = torch.randn(N_KV, GROUP, HEAD_DIM)
        choosing = torch.randn(N_KV, GROUP * args.choosing, HEAD_DIM)
        pages = tokens // 16
        summary = median_ms(lambda: archive.summary_bounds(choosing, pages), args.repeat)  # noqa: B023
        start = archive.token_index.view(pages, 16)[:, 0]
        if pages > args.shortlist:
            pick = median_ms(lambda: archive.shortlisted(choosing, pages, start), args.repeat)  # noqa: B023
            picked = archive.shortlisted(choosing, pages, start)
        else:  # every page is scored
            pick, picked = 0.0, torch.arange(pages).expand(N_KV, -1)
        mass = median_ms(lambda: archive.attention_mass(choosing, pages, picked), args.repeat)  # noqa: B023
        step = median_ms(lambda: archive.step_bounds(query), args.repeat)  # noqa: B023
        c_step = swept = choose = float("nan")
        if native.available():
            scores = StepScores(archive)
            c_step = median_ms(lambda: scores.bounds(query), args.repeat)  # noqa: B023
            layers = [StepScores(archive) for _ in range(args.layers)]  # one archive, each its own held keys

            def sweep(layers=layers) -> None:
                for layer in layers:
                    layer.bounds(query)  # noqa: B023

            swept = median_ms(sweep, max(3, args.repeat // 5)) / args.layers
            del layers
            choose = median_ms(c_choose(archive), args.repeat)
        asked = torch.randn(N_KV, GROUP * args.question, HEAD_DIM)
        question = median_ms(lambda: archive.attention_mass(asked, pages), max(3, args.repeat // 5))  # noqa: B023
        print(
            f"| {tokens:,} | {pages:,} | {summary:.2f} | {pick:.2f} | {mass:.2f} | {step:.2f} | {c_step:.2f} "
            f"| {swept:.2f} | {swept * LAYERS:.0f} | {question:.1f} | {choose:.2f} |"
        )
    if args.choosing > 1:
        print()
        for tokens in args.tokens:
            print(product_times(tokens, args.choosing, args.shortlist, args.repeat))


if __name__ == "__main__":
    main()
