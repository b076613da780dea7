"""Issue 6: PPL, COPA/PIQA accuracy, decode tok/s for {fp32, 8bit, 4bit} x {full, H2O@20%} x {kv 32, 8}.

Usage: python scripts/memory_results.py QUANT [--tokens 4096] [--examples 50]  (one quant per process)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from h2o_cli import choices
from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.generation import Sampling, generate_ids
from h2o_cli.models import load_model
from h2o_cli.streaming import prefill, stream_perplexity

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
BOOKS = ("frankenstein_pg84.txt", "pride_and_prejudice_pg1342.txt")


def settings(policy: str, tokens: int, kv_bits, chunk: int) -> CacheSettings:
    if policy == "full":  # a budget covering the whole stream never evicts: full attention (SPEC.md)
        return CacheSettings(budget=tokens, policy="h2o", chunk=chunk, kv_bits=kv_bits)
    return CacheSettings(budget=round(0.2 * tokens), policy="h2o", chunk=chunk, kv_bits=kv_bits)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("quant")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--examples", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32", quant=args.quant)
    books = [
        tokenizer((DATA / "gutenberg_books" / b).read_text()[:60000])["input_ids"][: args.tokens]
        for b in BOOKS
    ]
    copa = choices.copa_examples(DATA / "copa")[: args.examples]
    piqa = choices.piqa_examples(DATA / "piqa")[: args.examples]
    for kv_bits in (None, 8):
        for policy in ("full", "h2o"):
            row = {"quant": args.quant, "kv_bits": kv_bits or 32, "policy": policy, "tokens": args.tokens}
            with torch.no_grad():
                for name, ids in zip(BOOKS, books, strict=True):
                    cache = H2OCache(model, settings(policy, args.tokens, kv_bits, args.chunk))
                    stats = stream_perplexity(model, cache, [ids], args.chunk, None, None)
                    row[f"ppl_{name.split('_')[0]}"] = round(stats.ppl, 3)
                    row["cache_bytes"] = cache.nbytes()
                # decode: prefill 1024 tokens, then 32 greedy tokens, timed
                cache = H2OCache(model, settings(policy, 1024, kv_bits, args.chunk))
                logits, _ = prefill(model, cache, [books[0][:1024]], args.chunk, None, None)
                started = time.perf_counter()
                count = sum(1 for _ in generate_ids(model, cache, logits, Sampling(32, 0.0, 1.0, 0), set()))
                row["decode_tok_s"] = round(count / (time.perf_counter() - started), 2)
                ratio = None if policy == "full" else 0.2
                extra = {"kv_bits": kv_bits}
                row["copa"] = choices.accuracy(model, tokenizer, copa, ratio, **extra)
                row["piqa"] = choices.accuracy(model, tokenizer, piqa, ratio, **extra)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
