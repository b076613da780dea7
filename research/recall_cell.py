"""One `recall` pass-key cell, read and answered in-process (the model loaded before the clock), as JSON: the
way to time one code against another (two worktrees, each cell a fresh process, the two alternating).

    PYTHONPATH=TREE:TREE/kernels python research/recall_cell.py --dtype float32 --length 32768 --depth 50

Uses only `passkey.answer` and `passkey.haystacks` (the cells of `h2o passkey` and `bench_precision --parts
recall`), so it runs against older trees too.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", default="819")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from h2o_cli.cache.families import context_window
    from h2o_cli.config import CacheSettings
    from h2o_cli.eval.passkey import answer, correct, haystack_text, haystacks
    from h2o_cli.models import load_model

    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype=args.dtype)
    settings = CacheSettings(budget=args.budget, policy="recall").resolved(context_window(model))
    ((depth, key, text),) = haystacks(tokenizer, haystack_text(), args.length, [args.depth], args.seed)
    said, tokens, seconds = answer(model, tokenizer, settings, text)
    row = {"dtype": args.dtype, "length": args.length, "depth": depth, "key": key, "answer": said}
    row |= {"correct": correct(key, said), "seconds": seconds, "tokens": tokens, "load": os.getloadavg()}
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
