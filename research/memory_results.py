"""Quality and decode speed for {none, 8bit, 4bit} weights x {full, H2O@20%} x {kv 16, 8}.

    python -m research.memory_results quality QUANT --tokens 2048 --examples 50 >> docs/results/memory_quality.jsonl
    python -m research.memory_results decode --prompt 512 --new 64 > docs/results/memory_decode.jsonl
    python -m research.memory_results table docs/results/memory_quality.jsonl docs/results/memory_decode.jsonl

`quality` (one weights setting per process): perplexity of two books through `h2o_cli.eval.compare`, COPA and
PIQA accuracy (+ 95% Wilson CI) through the lm-eval `h2o` model, i.e. the same code as `h2o compare` and
`h2o eval`. `decode` times greedy decoding for every weights x KV setting in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from h2o_cli.config import CacheSettings
from h2o_cli.eval.compare import compare_perplexity
from h2o_cli.eval.data import data_dir
from h2o_cli.eval.scoring import CachePool
from h2o_cli.generation import Sampling, generate_ids
from h2o_cli.models import load_model
from h2o_cli.streaming import prefill

BOOKS = {"frankenstein": "frankenstein_pg84.txt", "pride": "pride_and_prejudice_pg1342.txt"}
QUANTS = ("none", "8bit", "4bit")
KV_BITS = (16, 8)
POLICIES = ("full", "h2o")
BUDGET = 0.2


def book_ids(tokenizer, name: str, tokens: int) -> list[int]:
    text = (data_dir() / "gutenberg_books" / BOOKS[name]).read_text(encoding="utf-8").lstrip("\ufeff")
    return tokenizer(text[: tokens * 16])["input_ids"][:tokens]


def quality(args) -> None:
    from h2o_cli.eval.lm_eval_model import H2OLM
    from h2o_cli.eval.runner import run_harness

    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32", quant=args.quant)
    lm = H2OLM(model=(model, tokenizer))
    books = {name: book_ids(tokenizer, name, args.tokens) for name in BOOKS}
    for kv_bits in KV_BITS:
        for policy in POLICIES:
            started = time.perf_counter()
            row = {"quant": args.quant, "kv_bits": kv_bits, "policy": policy, "tokens": args.tokens}
            for name, ids in books.items():
                base = CacheSettings(budget=BUDGET, chunk=args.chunk, kv_bits=kv_bits)
                (ppl,) = compare_perplexity(model, ids, [BUDGET], [policy], base)
                row[f"ppl_{name}"] = round(ppl["ppl"], 3)
                row["budget_tokens"] = ppl["budget_tokens"]
            spec = CacheSettings(budget=BUDGET, policy=policy, kv_bits=kv_bits)
            for task in ("copa", "piqa"):
                scored = run_harness(lm, task, spec, args.examples, 0, 1234, None)
                row[task] = {key: scored.get(key) for key in ("n", "acc", "ci_low", "ci_high")}
            row["seconds"] = round(time.perf_counter() - started, 1)
            print(json.dumps(row), flush=True)


def decode(args) -> None:
    load = os.getloadavg()
    for quant in QUANTS:
        model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32", quant=quant)
        prompt = book_ids(tokenizer, "frankenstein", args.prompt)
        for kv_bits in KV_BITS:
            for policy in POLICIES:
                spec = CacheSettings(budget=BUDGET, policy=policy, kv_bits=kv_bits)
                cache = CachePool(model, spec).cache_for(args.prompt, args.new)
                with torch.inference_mode():
                    logits, read = prefill(model, cache, [prompt], 128, None, None)
                    read.reraise()
                    started = time.perf_counter()
                    count = sum(1 for _ in generate_ids(model, cache, logits, Sampling(args.new), set()))
                    seconds = time.perf_counter() - started
                row = {
                    "quant": quant,
                    "kv_bits": kv_bits,
                    "policy": policy,
                    "budget_tokens": cache.report().resident_slots,
                    "prompt": args.prompt,
                    "new": count,
                    "tok_s": round(count / seconds, 2),
                    "threads": torch.get_num_threads(),
                    "loadavg_start": [round(value, 2) for value in load],
                    "loadavg_now": [round(value, 2) for value in os.getloadavg()],
                }
                print(json.dumps(row), flush=True)
        del model


def table(args) -> None:
    rows = [json.loads(line) for path in args.files for line in open(path, encoding="utf-8") if line.strip()]
    speed = {(r["quant"], r["kv_bits"], r["policy"]): r["tok_s"] for r in rows if "tok_s" in r}
    print(
        "| weights | KV | cache | PPL Frankenstein | PPL Pride & Prej. | COPA (95% CI) | PIQA (95% CI) | decode tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "tok_s" in r:
            continue
        key = (r["quant"], r["kv_bits"], r["policy"])
        cache = "full" if r["policy"] == "full" else f"H2O {BUDGET:.0%}"
        mc = [f"{r[t]['acc']:.2f} ({r[t]['ci_low']:.2f}–{r[t]['ci_high']:.2f})" for t in ("copa", "piqa")]
        print(
            f"| {'fp32' if r['quant'] == 'none' else r['quant']} | {'fp16' if r['kv_bits'] == 16 else 'int8'} "
            f"| {cache} | {r['ppl_frankenstein']:.3f} | {r['ppl_pride']:.3f} | {mc[0]} | {mc[1]} "
            f"| {speed.get(key, '–')} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    sub = parser.add_subparsers(dest="mode", required=True)
    q = sub.add_parser("quality")
    q.add_argument("quant", choices=QUANTS)
    q.add_argument("--tokens", type=int, default=2048)
    q.add_argument("--chunk", type=int, default=128)
    q.add_argument("--examples", type=int, default=50)
    d = sub.add_parser("decode")
    d.add_argument("--prompt", type=int, default=512)
    d.add_argument("--new", type=int, default=64)
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"quality": quality, "decode": decode, "table": table}[args.mode](args)


if __name__ == "__main__":
    main()
