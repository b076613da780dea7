"""Peak RSS and disk of a `recall` archive of the embedded model's shape filled to a million tokens.

No model forward: every layer's `PageArchive` (as `h2o_cli.cache.build.add_archives` makes them, one mapped
file) is written synthetic K/V through the real write path (`PageArchive.write`, pieces of `--piece` tokens),
and at each mark every layer makes a chunk's page choice (the shortlist over the section and block summaries,
as a chunk of text chooses) and layer 0 a question's (the attention mass over every archived page). One JSON
line per mark: tokens, peak and current RSS, the file's bytes on disk and the archive's RAM bytes.

    nice -n 10 python -m research.archive_reach --marks 131072 262144 524288 1048576 --bits 8

Run one per process (the peak RSS only grows); the file is removed at the end. Needs the disk the marks fill
(45 KiB of K/V and 11.25 KiB of summaries per token in float32, 12 KiB of K/V with `--bits 8`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.cache.recall.archive_file import ArchiveFile, aligned
from h2o_cli.cache.recall.limits import DEFAULT_ARCHIVE_MAX, summary_block
from h2o_cli.config import CacheSettings
from h2o_cli.policies import make_policy

# SmolLM2-135M: 30 layers of 3 KV heads (3 query heads each) x 64 dims.
LAYERS, N_KV, GROUP, HEAD_DIM = 30, 3, 3, 64


def rss() -> tuple[int, int]:
    """(peak, current) resident bytes of this process."""
    with open("/proc/self/statm") as statm:
        now = int(statm.read().split()[1]) * resource.getpagesize()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--marks", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    parser.add_argument("--bits", type=int, default=None, help="--archive-bits (None: float32)")
    parser.add_argument("--piece", type=int, default=256, help="tokens per write (a chunk)")
    parser.add_argument("--folder", default=None, help="where the archive's file goes (default: a temp dir)")
    args = parser.parse_args()
    torch.manual_seed(0)
    settings = CacheSettings(budget=819, policy="recall")
    pages = PageSettings.of(make_policy(settings))
    capacity = DEFAULT_ARCHIVE_MAX
    block = summary_block(pages.page_size, pages.block_size)
    region = aligned(PageArchive.stored_bytes(N_KV, HEAD_DIM, capacity, torch.float32, args.bits, block))
    folder = Path(args.folder or tempfile.mkdtemp(prefix="h2o-reach-"))
    file = ArchiveFile(folder / f"reach-{os.getpid()}.kv", region * LAYERS)
    cpu = torch.device("cpu")
    archives = [
        PageArchive(N_KV, HEAD_DIM, capacity, pages, torch.float32, cpu, args.bits, file.region(region))
        for _ in range(LAYERS)
    ]
    print(json.dumps({"start": True, "rss": rss(), "file_size": file.size, "bits": args.bits}), flush=True)
    written, began = 0, time.perf_counter()
    resident = torch.full((N_KV, 819), -1, dtype=torch.int64)
    for mark in sorted(args.marks):
        while written < mark:
            count = min(args.piece, mark - written)
            keys = torch.randn(N_KV, count, HEAD_DIM)
            values = torch.randn(N_KV, count, HEAD_DIM)
            for archive in archives:
                archive.write(keys, values)
            written += count
        query = torch.randn(N_KV, GROUP * settings.choice_tokens, HEAD_DIM)
        for archive in archives:
            archive.choose(query, resident, written, 410, chunk=settings.choice_tokens)
        archives[0].choose(query, resident, written, 410, chunk=settings.choice_tokens, question=True)
        peak, now = rss()
        row = {
            "tokens": written,
            "peak_rss_bytes": peak,
            "rss_bytes": now,
            "disk_bytes": os.stat(file.path).st_blocks * 512,
            "archive_ram_bytes": sum(archive.ram_bytes() for archive in archives),
            "choice_bytes": sum(archive.choice_bytes() for archive in archives),
            "seconds": round(time.perf_counter() - began, 1),
        }
        print(json.dumps(row), flush=True)
    file.close()


if __name__ == "__main__":
    main()
