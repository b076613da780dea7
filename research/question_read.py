"""How long a question's page choice takes over a disk archive that is past the page cache: one layer of the
embedded model's shape (3 KV heads of 64) archived to `--tokens` in a mapped file, synthetic K/V through the real
write path; the file's pages dropped from the page cache (`fsync`, then `POSIX_FADV_DONTNEED`), then the layer's
question choice (the attention mass over every archived page) timed, reading the layer ahead (`read_ahead`, the
tree's way) and page by page (`MADV_RANDOM` throughout, as before it), `--rounds` times each, alternating.

    nice python -m research.question_read --tokens 1048576 --rounds 3

One JSON line per timing, then the medians and their ratio. Needs the disk for one layer (1.9 KiB a token in
float32, K/V and summaries: 1.9 GiB at a million tokens); the file is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.cache.recall.archive_file import ArchiveFile, ArchiveRegion, aligned
from h2o_cli.cache.recall.limits import summary_block
from h2o_cli.config import CacheSettings
from h2o_cli.policies import make_policy
from research.bench_precision import cpu_name

N_KV, GROUP, HEAD_DIM = 3, 3, 64  # SmolLM2-135M's attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_048_576)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--question-tokens", type=int, default=16, help="the question's queries per KV head")
    parser.add_argument("--folder", default=None, help="where the file goes (default: a temp dir)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    pages = PageSettings.of(make_policy(CacheSettings(budget=819, policy="recall")))
    block = summary_block(pages.page_size, pages.block_size)
    size = aligned(PageArchive.stored_bytes(N_KV, HEAD_DIM, args.tokens, torch.float32, None, block))
    folder = Path(args.folder or tempfile.mkdtemp(prefix="h2o-question-"))
    file = ArchiveFile(folder / f"question-{os.getpid()}.kv", size)
    archive = PageArchive(N_KV, HEAD_DIM, args.tokens, pages, torch.float32, torch.device("cpu"), None,
                          file.region(size))  # fmt: skip
    for start in range(0, args.tokens, 8192):
        count = min(8192, args.tokens - start)
        archive.write(torch.randn(N_KV, count, HEAD_DIM), torch.randn(N_KV, count, HEAD_DIM))
    query = torch.randn(N_KV, GROUP * args.question_tokens, HEAD_DIM)
    resident = torch.full((N_KV, 819), -1, dtype=torch.int64)
    ahead = ArchiveRegion.read_ahead
    times: dict[str, list[float]] = {"in order": [], "page by page": []}
    for round_ in range(args.rounds):
        for way in ("in order", "page by page") if round_ % 2 == 0 else ("page by page", "in order"):
            ArchiveRegion.read_ahead = ahead if way == "in order" else lambda region: None
            os.fsync(file.descriptor)
            os.posix_fadvise(file.descriptor, 0, size, os.POSIX_FADV_DONTNEED)
            began = time.perf_counter()
            archive.choose(query, resident, args.tokens, 410, chunk=args.question_tokens, question=True)
            seconds = time.perf_counter() - began
            times[way].append(seconds)
            print(
                json.dumps({"tokens": args.tokens, "way": way, "round": round_, "seconds": round(seconds, 3)})
            )
    ArchiveRegion.read_ahead = ahead
    file.close()
    medians = {way: statistics.median(values) for way, values in times.items()}
    print(json.dumps({"tokens": args.tokens, "cpu": cpu_name(), "load": os.getloadavg(),
                      "median_s": {way: round(value, 3) for way, value in medians.items()},
                      "page_by_page_over_in_order": round(medians["page by page"] / medians["in order"], 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
