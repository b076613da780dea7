"""Does reading in bf16 keep perplexity, and how much faster is it? fp32 against `--dtype auto`, paired.

Loads the embedded model twice, `--dtype float32` and `--dtype auto` (on a CPU with native bf16: reads in
bf16, decode in fp32; h2o_cli/models/precision.py), and alternates the two in one process so that both see
the same load on a shared machine:

  read    `h2o stream --sample --ppl --budget 0.1` (chunks of 256): each chunk through both caches in turn
          (the first of the two alternating), the seconds of each forward + NLL summed per variant; the
          perplexity of each over the whole text (or `--max-tokens`). `--masked` adds fp32 with the chunk
          path's former layout (E_q as a mask over every slot), the read as it was before S in token order.
  decode  after reading `--context` tokens, `--steps` greedy steps of each, alternating step by step.
  recall  `h2o stream --policy recall --budget 819 --prompt` on pass-key haystacks of `--length` tokens
          (`h2o passkey`'s cells, $H2O_DATA's essays), each cell fp32 then auto (or the reverse): the
          seconds of each, and whether the answers agree and hold the key.

    H2O_DATA=/work/shared/data python -m research.bench_precision --parts read decode recall --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

VARIANTS = ("float32", "auto")
MASKED = "float32-masked"  # `read --masked`: fp32 on the chunk path's former layout


def load(threads: int) -> tuple[dict, object]:
    """({dtype: model}, the tokenizer)."""
    from h2o_cli.models import load_model

    torch.set_num_threads(threads)
    pairs = {dtype: load_model("smollm2-135m", device="cpu", dtype=dtype) for dtype in VARIANTS}
    models = {dtype: pair[0] for dtype, pair in pairs.items()}
    if getattr(models["auto"], "h2o_read_dtype", None) is None:
        raise SystemExit("--dtype auto reads in fp32 on this CPU (no native bf16): nothing to compare")
    return models, pairs["auto"][1]


def new_cache(model, budget: str, policy: str = "h2o", span: int | None = None):
    from h2o_cli.cache import H2OCache
    from h2o_cli.cache.families import context_window
    from h2o_cli.config import CacheSettings

    settings = CacheSettings(budget=budget, policy=policy).resolved(context_window(model))
    return H2OCache(model, settings, span=span)


def sample_ids(tokenizer, max_tokens: int | None) -> list[int]:
    """The ids `h2o stream --sample` reads (the same blocks and tokenizer calls)."""
    from h2o_cli.data import SAMPLE_TEXT
    from h2o_cli.textio import text_blocks, token_stream

    with open(SAMPLE_TEXT, "rb") as reader:
        ids = [i for piece in token_stream(tokenizer, text_blocks(reader, name="sample")) for i in piece]
    return ids[:max_tokens] if max_tokens else ids


def read(models, tokenizer, max_tokens: int | None, chunk: int = 256, masked: bool = False) -> dict:
    """`masked`: a third variant, fp32 with the chunk path's former layout (a mask over every slot, not S in
    token order: `ChunkPath.in_order` off), the path before that change, paired with the other two."""
    from h2o_cli.cache.paths.chunk import ChunkPath
    from h2o_cli.streaming import _chunk_nll, forward_chunk

    ids = sample_ids(tokenizer, max_tokens)
    variants = {name: (models[name], True) for name in VARIANTS}
    if masked:
        variants[MASKED] = (models["float32"], False)
    caches = {name: new_cache(model, "0.1") for name, (model, _) in variants.items()}
    seconds = dict.fromkeys(variants, 0.0)
    nll = dict.fromkeys(variants, 0.0)
    previous = dict.fromkeys(variants)
    for number, start in enumerate(range(0, len(ids), chunk)):
        piece = ids[start : start + chunk]
        for name in list(variants) if number % 2 == 0 else list(variants)[::-1]:
            model, ChunkPath.in_order = variants[name]
            started = time.perf_counter()
            with torch.inference_mode():
                logits = forward_chunk(model, caches[name], piece)
                loss, previous[name] = _chunk_nll(logits, piece, previous[name])
            seconds[name] += time.perf_counter() - started
            nll[name] += loss
    ChunkPath.in_order = True
    ppl = {name: float(torch.tensor(nll[name] / (len(ids) - 1)).exp()) for name in variants}
    return {
        "tokens": len(ids),
        "tokens_per_s": {name: len(ids) / seconds[name] for name in variants},
        "speedup": seconds["float32"] / seconds["auto"],
        "speedup_over_masked": {name: seconds[MASKED] / seconds[name] for name in variants}
        if masked
        else None,
        "ppl": ppl,
        "ppl_relative_change": ppl["auto"] / ppl["float32"] - 1,
    }


def decode(models, tokenizer, context: int, steps: int) -> dict:
    ids = sample_ids(tokenizer, context)
    seconds = dict.fromkeys(VARIANTS, 0.0)
    tokens = {}
    with torch.inference_mode():
        state = {}
        for dtype, model in models.items():
            cache = new_cache(model, "0.1")
            for start in range(0, len(ids), 256):
                piece = torch.tensor([ids[start : start + 256]])
                logits = model(input_ids=piece, cache=cache, use_cache=True, logits_to_keep=1).logits
            state[dtype] = [cache, int(logits[0, -1].argmax())]
            tokens[dtype] = []
        for number in range(steps + 1):
            for dtype in VARIANTS if number % 2 == 0 else VARIANTS[::-1]:
                cache, token = state[dtype]
                started = time.perf_counter()
                with cache.decode_threads.step(timed=number > 0):
                    logits = models[dtype](
                        input_ids=torch.tensor([[token]]), cache=cache, use_cache=True
                    ).logits
                state[dtype][1] = int(logits[0, -1].argmax())
                if number:  # the first step packs the cache after the read
                    seconds[dtype] += time.perf_counter() - started
                tokens[dtype].append(state[dtype][1])
    return {
        "context": len(ids),
        "steps": steps,
        "tokens_per_s": {dtype: steps / seconds[dtype] for dtype in VARIANTS},
        "speedup": seconds["float32"] / seconds["auto"],
        "same_tokens": tokens["float32"] == tokens["auto"],
    }


def recall(models, tokenizer, length: int, depths: list[int], seed: int, budget: str) -> list[dict]:
    from h2o_cli.cache.families import context_window
    from h2o_cli.config import CacheSettings
    from h2o_cli.eval.passkey import answer, correct, haystack_text, haystacks

    rows = []
    settings = CacheSettings(budget=budget, policy="recall").resolved(context_window(models["auto"]))
    for number, (depth, key, text) in enumerate(haystacks(tokenizer, haystack_text(), length, depths, seed)):
        row = {"length": length, "depth": depth, "seed": seed, "key": key}
        for dtype in VARIANTS if number % 2 == 0 else VARIANTS[::-1]:
            said, tokens, seconds = answer(models[dtype], tokenizer, settings, text)
            row[dtype] = {"answer": said, "correct": correct(key, said), "seconds": seconds, "tokens": tokens}
        row["speedup"] = row["float32"]["seconds"] / row["auto"]["seconds"]
        row["same_answer"] = row["float32"]["answer"] == row["auto"]["answer"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--parts", nargs="+", default=["read", "decode"], choices=["read", "decode", "recall"]
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="read: the first N tokens (default all)")
    parser.add_argument(
        "--masked",
        action="store_true",
        help="read: also fp32 on the chunk path's former layout (a mask over every slot)",
    )
    parser.add_argument("--context", type=int, default=1024, help="decode: tokens read before the steps")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--length", type=int, default=32768, help="recall: haystack tokens")
    parser.add_argument("--depths", type=int, nargs="+", default=[25, 75])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", default="819", help="recall's budget")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    models, tokenizer = load(args.threads)
    print(json.dumps({"cpu": cpu_name(), "threads": args.threads, "load": os.getloadavg()}), flush=True)
    if "read" in args.parts:
        print(json.dumps({"read": read(models, tokenizer, args.max_tokens, masked=args.masked)}), flush=True)
    if "decode" in args.parts:
        print(json.dumps({"decode": decode(models, tokenizer, args.context, args.steps)}), flush=True)
    if "recall" in args.parts:
        recall(models, tokenizer, args.length, args.depths, args.seed, args.budget)
    print(json.dumps({"load": os.getloadavg()}), flush=True)


def cpu_name() -> str:
    for line in open("/proc/cpuinfo", encoding="utf-8"):
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "?"


if __name__ == "__main__":
    main()
