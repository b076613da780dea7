"""Where a read chunk's and a decode step's time goes, fp32 against `--dtype auto` (bf16 reads).

Reads `--context` tokens of the shipped sample into an h2o cache (`--policy`, budget 10 %, chunks of 256, as
`h2o stream --sample --ppl` does), then profiles `--chunks` more chunks with their perplexity (logits of every
row, log-softmax, NLL) and `--steps` greedy decode steps, under torch.profiler, for each dtype in turn. Each
part is split into the model's linear layers (`lm_head` apart), the cache (`H2OLayer.update` + `attend`: RoPE
undo/redo, attention, scores, eviction), the NLL, and the rest (norms, activations, residuals, embedding,
Python); `--rows N` also prints the profiler's top N ops by self time.

    python -m research.profile_read --threads 2 --chunks 4 --steps 16 --rows 20
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from research.profile_decode import labelled as ranged  # wraps a method in a profiler range


def split(prof, label: str, count: int) -> dict[str, float]:
    """ms per `label` range of each part (CPU totals, children included)."""
    total = {event.key: event.cpu_time_total / 1e3 / count for event in prof.key_averages()}
    whole = total.get(label, 0.0)
    head = total.get("lm_head", 0.0)
    linear = total.get("aten::linear", 0.0) - head
    cache = total.get("cache:update", 0.0) + total.get("cache:attend", 0.0)
    nll = total.get("nll", 0.0)
    parts = {"whole": whole, "linears (layers)": linear, "lm_head": head, "cache": cache, "nll": nll}
    parts["rest"] = whole - linear - head - cache - nll
    return parts


def run(model, tokenizer, ids, args) -> None:
    from h2o_cli.cache import H2OCache
    from h2o_cli.cache.families import context_window
    from h2o_cli.config import CacheSettings
    from h2o_cli.streaming import _chunk_nll

    settings = CacheSettings(budget="0.1", policy=args.policy).resolved(context_window(model))
    cache = H2OCache(model, settings)
    for layer in cache.layers:
        ranged(layer, "update", "cache:update")
        ranged(layer, "attend", "cache:attend")
    ranged(model.lm_head, "forward", "lm_head")
    chunk, read = 256, args.context
    with torch.inference_mode():
        for start in range(0, read, chunk):
            model(input_ids=torch.tensor([ids[start : start + chunk]]), cache=cache, use_cache=True)
        with profile(activities=[ProfilerActivity.CPU]) as chunks:
            for start in range(read, read + args.chunks * chunk, chunk):
                piece = ids[start : start + chunk]
                with record_function("read_chunk"):
                    logits = model(input_ids=torch.tensor([piece]), cache=cache, use_cache=True).logits[0]
                    with record_function("nll"):
                        _, last = _chunk_nll(logits.float(), piece, None)
        token = int(last.argmax())
        for _ in range(2):  # the first step packs the cache
            token = int(model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits.argmax())
        with profile(activities=[ProfilerActivity.CPU]) as steps:
            for _ in range(args.steps):
                with record_function("decode_step"):
                    logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits
                token = int(logits[0, -1].argmax())
    for name, prof, label, count in (
        ("read chunk (256 tokens)", chunks, "read_chunk", args.chunks),
        ("decode step", steps, "decode_step", args.steps),
    ):
        parts = split(prof, label, count)
        print(
            f"\n{name}, ms each: | "
            + " | ".join(f"{k} {v:.2f} ({v / parts['whole']:.0%})" for k, v in parts.items())
        )
        if args.rows:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=1024, help="tokens read before profiling")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--policy", default="h2o", help="the cache's policy (budget 10 %% of the window)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=0)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "auto"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from h2o_cli.models import load_model
    from research.bench_precision import sample_ids

    for dtype in args.dtypes:
        model, tokenizer = load_model("smollm2-135m", device="cpu", dtype=dtype)
        ids = sample_ids(tokenizer, args.context + args.chunks * 256)
        print(f"\n## --dtype {dtype}: threads {args.threads}, load {os.getloadavg()[0]:.2f}")
        run(model, tokenizer, ids, args)
        del model


if __name__ == "__main__":
    main()
