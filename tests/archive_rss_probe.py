"""Peak RSS of a `recall` stream through a random-weight model with a wide KV (64 KiB of K/V per token).

Run as a script (a fresh process per measurement: ru_maxrss only grows):
    python tests/archive_rss_probe.py ARCHIVE TOKENS [TOKENS ...]
streams the largest TOKENS in chunks and prints one JSON object: the peak RSS after each TOKENS mark, and the
archive's figures. The archive's cap exceeds the stream, so a RAM archive holds every token's K/V.
"""

from __future__ import annotations

import json
import resource
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings

CHUNK = 128
# 8 layers x 16 KV heads x 64 dims x K and V x fp32 = 64 KiB per token: 1,536 tokens = 96 MiB of archive.
WIDE_KV = dict(
    vocab_size=128,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """Resident bytes now (`/proc/self/statm`): unlike the peak, not hidden by an earlier transient."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def main(archive: str, marks: list[int]) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = LlamaForCausalLM(LlamaConfig(**WIDE_KV)).eval()
    # The attention score reads the keys of the shortlisted pages, one layer at a time (8 pages of 16 here):
    # what it maps is bounded by the shortlist, not by the text.
    settings = CacheSettings(
        budget=64, policy="recall", chunk=CHUNK, archive=archive, archive_max=4096, shortlist=8
    )
    cache = H2OCache(model, settings)
    ids = torch.randint(0, 128, (1, max(marks)), generator=torch.Generator().manual_seed(1))
    peaks, now = {}, {}
    with torch.inference_mode():
        for start in range(0, ids.shape[1], CHUNK):
            model(ids[:, start : start + CHUNK], cache=cache)
            if start + CHUNK in marks:
                peaks[start + CHUNK] = peak_rss()
                now[start + CHUNK] = current_rss()
    return {"peak_rss_bytes": peaks, "rss_bytes": now, **cache.report().archive_row}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], [int(mark) for mark in sys.argv[2:]])))
