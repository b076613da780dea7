"""Where a decode step's time goes: torch.profiler over decode steps of the embedded model, h2o vs plain.

Reads `--context` tokens of War and Peace (chunks of 256), then profiles `--steps` greedy decode steps
(after `--warmup` unprofiled ones) and splits the time into: the cache and attention code (`H2OLayer.update`
+ `attend`, or sdpa + `DynamicCache.update` for plain transformers), the model's linear layers (the
output projection apart), and the rest (norms, RoPE of q/k, MLP activation, residuals, embedding, Python).

    python research/profile_decode.py --context 4096 --budget 0.1 --threads 1
    python research/profile_decode.py --context 4096 --budget 0.1 --threads 1 --wall   # no profiler
    python research/profile_decode.py --context 4096 --budget 410 --policies h2o recall --ops --parts

`--wall` times the h2o/plain split with the clock alone (rounds alternating h2o and plain): the profiler's cost
per op inflates a step made of many small ops, and it cannot see inside the C decode step (`--kernels native`).

`--policies` names the caches profiled (default: h2o and plain transformers); `recall` splits its cache time
further with `--parts` (archive write, page choice and the page bound inside it, read-back; with the C step,
`c_choose` is the choice after the bound with the read-back, `c_step` the attention, scores and eviction,
`step_scores` an answer step's page scores over its shortlist's held keys).

`--ops` also counts the tensor ops one decode step dispatches in the cache code of one layer (the second:
the first builds the pass's shared tables), views and no-op casts aside.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

BOOK = Path("gutenberg_books/war_and_peace_pg2600.txt")


def labelled(owner, name: str, label: str) -> None:
    """Wrap `owner.name` in a profiler range called `label` (the script's own patch; nothing in h2o_cli)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        with record_function(label):
            return inner(*args, **kwargs)

    setattr(owner, name, wrapper)


def prefill(model, cache, ids: list[int], chunk: int) -> int:
    token = None
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            piece = torch.tensor([ids[start : start + chunk]])
            token = int(
                model(input_ids=piece, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax()
            )
    return token


def decode(model, cache, token: int, steps: int) -> int:
    with torch.inference_mode():
        for _ in range(steps):
            with record_function("decode_step"):
                logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits
                token = int(logits[0, -1].argmax())
    return token


VIEWS = {"view", "alias", "slice", "select", "unsqueeze", "expand", "transpose", "reshape", "as_strided", "t",
         "chunk", "split", "detach", "_unsafe_view", "to", "squeeze", "permute"}  # fmt: skip


def count_ops(model, cache, token: int, layer) -> collections.Counter:
    """Tensor ops dispatched by `layer.update` + `layer.attend` in one decode step (views aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in VIEWS and "record_function" not in str(func):
                self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    counter = Counter()
    inner = {name: getattr(layer, name) for name in ("update", "attend")}

    def counted(name):
        def call(*args, **kwargs):
            with counter:
                return inner[name](*args, **kwargs)

        return call

    for name in inner:
        setattr(layer, name, counted(name))
    try:
        decode(model, cache, token, 1)
    finally:
        for name, method in inner.items():
            setattr(layer, name, method)
    return counter.ops


def shares(prof, steps: int) -> dict[str, float]:
    """ms per step of each part, from the profiler's ranges and ops (CPU totals, children included)."""
    events = prof.key_averages()
    total = {e.key: e.cpu_time_total / 1e3 / steps for e in events}
    step = total.get("decode_step", 0.0)
    cache = total.get("cache:update", 0.0) + total.get("cache:attend", 0.0)
    linear = total.get("aten::linear", 0.0)
    head = total.get("lm_head", 0.0)
    parts = {"step": step, "cache and attention": cache, "linears (30 layers)": linear - head,
             "output projection": head, "rest": step - cache - linear}  # fmt: skip
    for label in ("recall:archive_write", "recall:choose", "recall:page_bound", "recall:read_back",
                  "recall:c_choose", "recall:c_step", "recall:step_scores"):  # fmt: skip
        if label in total:
            parts[f"  of the cache: {label.split(':')[1]}"] = total[label]
    return parts


class WallClock:
    """Wall time inside the wrapped cache/attention functions, per decode step (no profiler: its cost per op
    would inflate a step of many small ops, and it does not see inside the C step)."""

    def __init__(self) -> None:
        self.inside = 0.0

    def timed(self, inner):
        """`inner`, adding its wall time to `inside`."""

        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - started

        return call

    def wrap(self, owner, name: str) -> None:
        setattr(owner, name, self.timed(getattr(owner, name)))

    def steps(self, model, cache, token: int, steps: int) -> tuple[list[tuple[float, float]], int]:
        """(step seconds, seconds in the cache code) of each of `steps` greedy decode steps."""
        out = []
        with torch.inference_mode():
            for _ in range(steps):
                self.inside = 0.0
                started = time.perf_counter()
                logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits
                token = int(logits[0, -1].argmax())
                out.append((time.perf_counter() - started, self.inside))
        return out, token


def wall_split(model, ids: list[int], budget: int, args) -> None:
    """Median wall-clock split of h2o's and plain transformers' decode steps, rounds alternating."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.cache_utils import DynamicLayer

    from h2o_cli.cache import H2OCache, H2OLayer
    from h2o_cli.config import CacheSettings

    clock = WallClock()
    for owner, name in ((H2OLayer, "update"), (H2OLayer, "attend"), (DynamicLayer, "update")):
        clock.wrap(owner, name)
    sdpa = AttentionInterface._global_mapping["sdpa"]
    AttentionInterface._global_mapping["sdpa"] = clock.timed(sdpa)  # plain transformers' attention function
    h2o = H2OCache(model, CacheSettings(budget=budget, chunk=args.chunk, kernels=args.kernels))
    h2o_token = prefill(model, h2o, ids, args.chunk)
    model.set_attn_implementation("sdpa")
    plain = DynamicCache(config=model.config)
    plain_token = prefill(model, plain, ids, args.chunk)
    samples: dict[str, list[tuple[float, float]]] = {"h2o": [], "plain": []}
    for _ in range(args.rounds):
        model.set_attn_implementation("h2o")
        got, h2o_token = clock.steps(model, h2o, h2o_token, args.steps)
        samples["h2o"] += got[1:]
        model.set_attn_implementation("sdpa")
        got, plain_token = clock.steps(model, plain, plain_token, args.steps)
        samples["plain"] += got[1:]
    model.set_attn_implementation("h2o")
    AttentionInterface._global_mapping["sdpa"] = sdpa
    print(f"\nwall clock, median of {len(samples['h2o'])} steps per side (load {os.getloadavg()[0]:.2f}):")
    print("| side | ms/step | cache and attention | share |\n|---|---|---|---|")
    for name, rows in samples.items():
        step = statistics.median(r[0] for r in rows) * 1e3
        inside = statistics.median(r[1] for r in rows) * 1e3
        print(f"| {name} | {step:.2f} | {inside:.2f} ms | {inside / step:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget", default="0.1", help="fraction of --context, or a token count")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--rows", type=int, default=0, help="also print the profiler's top N ops")
    parser.add_argument("--ops", action="store_true", help="count one layer's tensor ops per decode step")
    parser.add_argument("--wall", action="store_true", help="wall-clock split instead of the profiler")
    parser.add_argument("--rounds", type=int, default=3, help="--wall: alternating rounds of --steps each")
    parser.add_argument("--kernels", default="auto", help="h2o's --kernels (torch: the torch decode step)")
    parser.add_argument("--policies", nargs="+", default=["h2o", "plain"], help="h2o, recall, plain")
    parser.add_argument(
        "--parts",
        action="store_true",
        help="recall: time its archive write, choice, read-back (and the C step's two calls)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import DynamicCache

    from h2o_cli.cache import H2OCache
    from h2o_cli.config import CacheSettings
    from h2o_cli.models import load_model

    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    book = Path(os.environ["H2O_DATA"]) / BOOK
    ids = tokenizer(book.read_text(encoding="utf-8")[:200_000])["input_ids"][: args.context]
    fraction = float(args.budget) if float(args.budget) <= 1 else None
    budget = max(2, round(args.context * fraction)) if fraction else int(args.budget)
    if args.wall:
        print(f"threads {args.threads}, context {args.context}, h2o budget {budget}, kernels {args.kernels}")
        wall_split(model, ids, budget, args)
        return
    labelled(DynamicCache, "update", "cache:update")
    head = model.lm_head
    head_forward = head.forward
    head.forward = lambda x: _ranged("lm_head", head_forward, x)
    from transformers import AttentionInterface

    sdpa = AttentionInterface._global_mapping["sdpa"]

    def ranged_sdpa(*a, **k):  # plain transformers' attention function, repeat_kv and all
        with record_function("cache:attend"):
            return sdpa(*a, **k)

    print(f"threads {args.threads}, context {args.context}, budget {budget}, chunk {args.chunk}")
    for name in args.policies:
        if name != "plain":
            model.set_attn_implementation("sdpa")  # H2OCache switches it to h2o
            cache = H2OCache(
                model, CacheSettings(budget=budget, chunk=args.chunk, policy=name, kernels=args.kernels)
            )
            for layer in cache.layers:  # per instance: a subclass's super() calls are not ranged twice
                labelled(layer, "update", "cache:update")
                labelled(layer, "attend", "cache:attend")
                if name == "recall" and args.parts:
                    labelled(layer.archive, "write", "recall:archive_write")
                    labelled(layer.archive, "choose", "recall:choose")
                    labelled(layer.archive, "choose_one", "recall:choose")
                    labelled(layer, "_read_back", "recall:read_back")
            if name == "recall" and args.parts:  # inside the page choice: the bound over every written page
                from h2o_kernels import native

                import h2o_cli.cache.recall.scores

                labelled(h2o_cli.cache.recall.scores, "best_page_bound", "recall:page_bound")
                # The C step (a full S, float32 RAM archive): its choice and read-back, and the rest of it.
                labelled(native, "archive_choose", "recall:c_choose")
                labelled(native, "step", "recall:c_step")
                labelled(native, "archive_step_scores", "recall:step_scores")  # an answer step's page scores
        else:
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
        if name == "plain":
            AttentionInterface._global_mapping["sdpa"] = ranged_sdpa
        token = prefill(model, cache, ids, args.chunk)
        token = decode(model, cache, token, args.warmup)
        if args.ops and name != "plain":
            ops = count_ops(model, cache, token, cache.layers[1])
            print(f"{name}: {sum(ops.values())} tensor ops per layer call: {dict(ops.most_common())}")
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode(model, cache, token, args.steps)
        elapsed = (time.perf_counter() - started) / args.steps * 1e3
        AttentionInterface._global_mapping["sdpa"] = sdpa
        parts = shares(prof, args.steps)
        print(f"\n{name}: {elapsed:.1f} ms/step under the profiler")
        print("| part | ms/step | share |\n|---|---|---|")
        for part, ms in parts.items():
            print(f"| {part} | {ms:.2f} | {ms / parts['step']:.0%} |")
        if args.rows:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


def _ranged(label: str, function, *args):
    with record_function(label):
        return function(*args)


if __name__ == "__main__":
    main()
