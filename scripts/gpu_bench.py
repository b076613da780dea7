"""The GPU bench: plain transformers vs h2o on a random-weight Llama-2-7B-shaped model, and the kernels per call.

Two parts, each row guarded (a row that fails or runs past its time limit prints one line and the rest go on):

- `kernels`: one attention call per shape, CUDA events: the fused Triton decode kernel (split slot axis) vs
  the torch reference (`h2o_kernels.decode`, the path `--kernels auto` takes) vs SDPA (no scores, no
  rotation); the same for a prefill chunk.
- `model`: bf16 Llama-2-7B shape (hidden 4096, 32 layers, 32 heads = 32 KV heads, MLP 11008, vocab 32000),
  random weights (speed does not depend on them), contexts 4K/16K/32K read in chunks, then greedy decode:
  plain transformers (sdpa + `DynamicCache`; static cache + `torch.compile`), h2o at 10 % (torch path; Triton
  decode; captured: the fixed decode step under `CompiledStep`, its K/V kept in bf16 and its attention and
  scores computed in float32), `recall` at the same budget (its archive on the GPU, each head's own page
  choice), and h2o on 4-bit weights (bitsandbytes nf4). Per row: prefill and decode
  tok/s, peak GPU memory (`torch.cuda.max_memory_allocated`, reset per row), the cache's own bytes.

The timing is `h2o_cli.bench_speed`'s (`fill`, `greedy_decode`, `PlainSide`): the loop `h2o bench` runs on a CPU.

    python scripts/gpu_bench.py                      # on a GPU: writes docs/benchmarks.md's GPU table
    python scripts/gpu_bench.py --dry-run            # every row on a tiny config on the CPU, in seconds

`--dry-run` runs the same rows on a 2-layer model (contexts 64/128, Triton kernels under TRITON_INTERPRET=1,
`torch.compile` with the eager backend) to check the script, not to measure anything; `--dtype bfloat16` runs
its model part in the GPU's dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTION = "gpu-bench"
VARIANTS = (
    "plain sdpa + DynamicCache",
    "h2o 10% torch path",
    "h2o 10% Triton decode",
    "plain static cache + torch.compile",
    "h2o 10% captured/compiled",
    "h2o 10% torch path, 4-bit weights",
    "recall 10% torch path",
)
COLUMNS = ("variant", "context", "kept", "prefill tok/s", "decode tok/s", "peak GPU GiB", "cache MiB", "note")


class RowTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise `RowTimeout` in this (main) thread after `seconds`."""

    def expired(signum, frame):
        raise RowTimeout(f"ran past its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def guarded(label: str, limit: float, fn: Callable[[], dict], rows: list[dict], base: dict) -> None:
    """Run one row; a failure (or the time limit) becomes the row's note, printed as one line."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        with time_limit(limit):
            row = {**base, **fn()}
        if torch.cuda.is_available():
            row["peak GPU GiB"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as error:  # noqa: BLE001 - one row's failure must not end the bench
        message = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        row = {**base, "note": f"failed: {message}"}
    row["seconds"] = time.perf_counter() - started
    rows.append(row)
    print(f"[{label}] " + json.dumps({k: v for k, v in row.items()}, default=str), flush=True)


def timed(fn: Callable[[], object], repeats: int, cuda: bool) -> float:
    """Mean milliseconds per call after two warm-up calls (CUDA events on a GPU)."""
    import torch

    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) * 1000 / repeats


# ------------------------------------------------------------------------------------------------ kernels
def kernel_rows(dry: bool, limit: float, deadline: float) -> list[dict]:
    """Per call: fused Triton vs torch reference vs SDPA, decode at several slot counts and one prefill chunk."""
    import torch
    import torch.nn.functional as F
    from h2o_kernels import decode as ref_decode
    from h2o_kernels import prefill as ref_prefill

    cuda = torch.cuda.is_available() and not dry
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = [(4, 2, 32)] if dry else [(9, 3, 64), (32, 8, 128), (32, 32, 128)]
    slot_counts = (96,) if dry else (1024, 4096, 16384, 32768)
    prefill_shape = (16, 96) if dry else (1024, 4096)  # (chunk, slots)
    repeats = 1 if dry else 20
    rows: list[dict] = []
    try:
        from h2o_kernels import triton_decode, triton_prefill
    except Exception as error:  # noqa: BLE001 - no triton: the fused column says why
        triton_decode = triton_prefill = None
        print(f"[kernels] Triton not importable: {error}")

    def tables(length: int, d: int):
        ang = torch.arange(length, device=dev)[:, None] * (
            1e-4 ** (torch.arange(d // 2, device=dev) / (d // 2))
        )
        ang = torch.cat((ang, ang), -1)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def cells(fused, reference, sdpa, count: int) -> dict[str, Callable[[], float | str]]:
        """The three timings of one row; `fused` is None when triton is not importable."""
        return {
            "fused": (lambda: "no triton") if fused is None else (lambda: timed(fused, count, cuda)),
            "torch": lambda: timed(reference, count, cuda),
            "sdpa": lambda: timed(sdpa, count, cuda),
        }

    def decode_row(n_heads: int, n_kv: int, d: int, slots: int) -> dict:
        q = torch.randn(n_heads, d, device=dev, dtype=dtype)
        k = torch.randn(n_kv, slots, d, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        valid = torch.ones(n_kv, slots, dtype=torch.bool, device=dev)
        pos = torch.arange(slots, device=dev).expand(n_kv, slots).contiguous()
        cos, sin = tables(slots + 1, d)
        scores = torch.zeros(n_kv, slots, device=dev)
        args = (q, k, v, valid, pos, pos, pos, slots, cos, sin, d**-0.5, scores, slots - 64)
        kk = k.repeat_interleave(n_heads // n_kv, 0)[None]
        vv = v.repeat_interleave(n_heads // n_kv, 0)[None]
        base = {"kind": "decode", "shape": f"{n_heads} heads, {n_kv} KV, d {d}", "slots": slots}
        fused = None if triton_decode is None else (lambda: triton_decode.decode_attention(*args))
        timings = cells(fused, lambda: ref_decode.decode_attention(*args),
                        lambda: F.scaled_dot_product_attention(q[None, :, None], kk, vv), repeats)  # fmt: skip
        return kernel_row(base, timings, limit, deadline)

    def prefill_row(n_heads: int, n_kv: int, d: int, chunk: int, slots: int) -> dict:
        q = torch.randn(n_heads, chunk, d, device=dev, dtype=dtype)
        k = torch.randn(n_kv, slots, d, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        valid = torch.ones(n_kv, slots, dtype=torch.bool, device=dev)
        tok = torch.arange(slots, device=dev).expand(n_kv, slots).contiguous()
        cos, sin = tables(slots + 1, d)
        args = (q, k, v, valid, tok, tok, slots - chunk, slots - chunk, cos, sin, d**-0.5)
        kk = k.repeat_interleave(n_heads // n_kv, 0)[None]
        vv = v.repeat_interleave(n_heads // n_kv, 0)[None]
        base = {
            "kind": f"prefill chunk {chunk}",
            "shape": f"{n_heads} heads, {n_kv} KV, d {d}",
            "slots": slots,
        }
        fused = None if triton_prefill is None else (lambda: triton_prefill.prefill_attention(*args))
        timings = cells(fused, lambda: ref_prefill.prefill_attention(*args),
                        lambda: F.scaled_dot_product_attention(q[None], kk, vv, is_causal=False),
                        max(1, repeats // 4))  # fmt: skip
        return kernel_row(base, timings, limit, deadline)

    for n_heads, n_kv, d in shapes:
        rows += [decode_row(n_heads, n_kv, d, slots) for slots in slot_counts]
        rows.append(prefill_row(n_heads, n_kv, d, *prefill_shape))
    return rows


def kernel_row(
    base: dict, cells: dict[str, Callable[[], float | str]], limit: float, deadline: float
) -> dict:
    row = dict(base)
    for name, cell in cells.items():
        if deadline - time.perf_counter() < 1:
            row[name] = "skipped: the kernel part's time was spent"
            continue
        try:
            with time_limit(min(limit, deadline - time.perf_counter())):
                row[name] = cell()
        except Exception as error:  # noqa: BLE001
            row[name] = f"failed: {type(error).__name__}: {error}".splitlines()[0][:120]
    print("[kernels] " + json.dumps(row, default=str), flush=True)
    return row


# ------------------------------------------------------------------------------------------------ model
def model_config(dry: bool, longest: int):
    from transformers import LlamaConfig

    if dry:
        return LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           intermediate_size=128, vocab_size=256, max_position_embeddings=4 * longest)  # fmt: skip
    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       intermediate_size=11008, vocab_size=32000, max_position_embeddings=max(4 * longest, 65536),
                       rms_norm_eps=1e-5)  # fmt: skip


def model_dtype(name: str, cuda: bool):
    """The model part's dtype: `--dtype`, where "auto" is bf16 on a GPU and float32 on the CPU."""
    import torch

    if name == "auto":
        return torch.bfloat16 if cuda else torch.float32
    return getattr(torch, name)


def build_model(config, device: str, dtype):
    """Random weights made on the device itself (a 7B init on a GPU takes seconds)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def quantize_4bit(model, dtype) -> None:
    """Replace every decoder Linear by bitsandbytes' nf4 `Linear4bit` (what `--quant 4bit` loads), in place."""
    import bitsandbytes as bnb
    import torch

    device = next(model.parameters()).device
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear):
                    continue
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=dtype, quant_type="nf4", device="meta")  # fmt: skip
                quantized.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
                quantized = quantized.to(device)
                setattr(parent, name, quantized)
                del child
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Compiled:
    """A model's forward under `torch.compile`, callable the way `greedy_decode` calls a model."""

    def __init__(self, model, **options) -> None:
        import torch

        self.device = model.device
        self.forward = torch.compile(model.forward, **options)

    def __call__(self, **inputs):
        return self.forward(**inputs)


def model_rows(args, contexts: list[int], deadline: float) -> tuple[list[dict], dict]:
    import torch
    from transformers import DynamicCache, StaticCache

    from h2o_cli.bench_speed import PlainSide, fill, greedy_decode, h2o_budget, plain_attention
    from h2o_cli.cache import H2OCache
    from h2o_cli.runtime import make_settings

    dry = args.dry_run
    cuda = torch.cuda.is_available() and not dry
    device, dtype = ("cuda" if cuda else "cpu"), model_dtype(args.dtype, cuda)
    config = model_config(dry, contexts[-1])
    built = time.perf_counter()
    model = build_model(config, device, dtype)
    print(f"[model] built {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters on {device} in "
          f"{time.perf_counter() - built:.1f} s", flush=True)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (contexts[-1] + 4 * args.tokens + 8,), generator=gen).tolist()
    tokens, chunk = args.tokens, args.chunk
    rows: list[dict] = []
    memory: dict = {}
    with plain_attention(model):  # lazy initialisation (kernels, handles) outside every row's timing
        warm = DynamicCache(config=model.config)
        greedy_decode(model, warm, fill(model, warm, ids[:64], chunk), 2)
        del warm

    def left() -> float:
        return deadline - time.perf_counter()

    def limit(scale: float = 1.0) -> float:
        return min(args.row_limit * scale, left())

    def run(variant: str, context: int, fn: Callable[[], dict], scale: float = 1.0) -> None:
        base = {"variant": variant, "context": context}
        if left() < 5:
            rows.append({**base, "note": "skipped: the bench's time was spent"})
            print(f"[model] {variant} @ {context}: skipped (out of time)", flush=True)
            return
        guarded(f"model {variant} @ {context}", limit(scale), fn, rows, base)

    kept: dict = {}  # the torch row's cache, decoded on further by the Triton row of the same context

    def on_kernels(kernels: str, fn: Callable[[], object]):
        """`fn()` with the cache's `--kernels auto` read as `kernels` ($H2O_KERNELS, read per call)."""
        os.environ["H2O_KERNELS"] = kernels
        try:
            return fn()
        finally:
            os.environ.pop("H2O_KERNELS", None)

    def h2o_filled(context: int, policy: str = "h2o") -> tuple[object, int, float]:
        """A fresh cache of `policy` that read `context` ids on the torch path: (cache, next token, prefill
        seconds)."""
        budget = h2o_budget(context, args.fraction)
        settings = make_settings(model, str(budget), policy, chunk=chunk, kernels="auto")
        cache = H2OCache(model, settings, archive_span=context + tokens + 8)  # recall: archive this text
        started = time.perf_counter()
        token = on_kernels("torch", lambda: fill(model, cache, ids[:context], chunk))
        return cache, token, time.perf_counter() - started

    def h2o_row(context: int, name: str, keep: bool = False, policy: str = "h2o") -> dict:
        """A fresh cache of `policy` on the torch path; with `recall` its archive (on the GPU) counts in the
        cache's bytes, and each head chooses its own pages (no lead head is known for this model)."""
        from h2o_cli.cache.recall.layer import RecallLayer

        cache, token, prefill_s = h2o_filled(context, policy)
        speed, token = on_kernels("torch", lambda: greedy_decode(model, cache, token, tokens))
        if keep:
            kept.update(context=context, cache=cache, token=token)
        archive = sum(layer.archive.nbytes() for layer in cache.layers if isinstance(layer, RecallLayer))
        if context == contexts[-1]:
            memory[name] = cache.nbytes() + archive
        budget = h2o_budget(context, args.fraction)
        row = {"kept": budget, "prefill tok/s": context / prefill_s, "decode tok/s": speed,
               "cache MiB": (cache.nbytes() + archive) / 2**20}  # fmt: skip
        if archive:
            row["note"] = f"archive {archive / 2**20:,.1f} MiB of it"
        return row

    def triton_row(context: int) -> dict:
        from h2o_kernels import dispatch

        if kept.get("context") == context:
            cache, token, prefill = kept["cache"], kept["token"], None
            note = "continues the torch row's cache (same prefill)"
        else:
            cache, token, prefill_s = h2o_filled(context)
            prefill, note = context / prefill_s, "prefill on the torch path"
        kept.clear()
        if not dispatch.use_triton(torch.device(device), "triton"):
            note += "; decode on the torch path: Triton does not run here" + (
                f" ({dispatch._failure})" if dispatch._failure else " (needs CUDA)"
            )
        speed, _ = on_kernels("triton", lambda: greedy_decode(model, cache, token, tokens))
        if dispatch._failure:
            note = f"Triton failed, the torch path ran: {dispatch._failure}"
        return {"kept": h2o_budget(context, args.fraction), "prefill tok/s": prefill, "decode tok/s": speed,
                "cache MiB": cache.nbytes() / 2**20, "note": note}  # fmt: skip

    # plain transformers, one DynamicCache topped up from context to context (as `h2o bench` does)
    plain = PlainSide(model, ids, tokens, chunk)
    for context in contexts:

        def plain_row(context=context) -> dict:
            started, seen = time.perf_counter(), plain.seen
            speed = plain.decode(context)
            seconds = time.perf_counter() - started - tokens / speed
            cache_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in plain.cache.layers)
            if context == contexts[-1]:
                memory["full KV (DynamicCache)"] = cache_bytes
            return {"kept": context, "prefill tok/s": (context - seen) / seconds, "decode tok/s": speed,
                    "cache MiB": cache_bytes / 2**20}  # fmt: skip

        run(VARIANTS[0], context, plain_row)
    plain = None  # its cache's memory back before the h2o rows

    for context in contexts:  # the Triton row decodes on the torch row's cache, after it
        run(VARIANTS[1], context, lambda context=context: h2o_row(context, VARIANTS[1], keep=True))
        run(VARIANTS[2], context, lambda context=context: triton_row(context))
        kept.clear()

    # static cache sized for the longest context, decode compiled (CUDA graphs on a GPU); compiled once
    static: dict = {}

    def static_row(context: int) -> dict:
        if not static:
            static["length"] = contexts[-1] + 4 * tokens + 8
            static["cache"] = StaticCache(config=model.config, max_cache_len=static["length"])
            options = {"backend": "eager"} if not cuda else {"mode": "reduce-overhead", "fullgraph": False}
            static["model"], static["seen"], static["options"] = Compiled(model, **options), 0, options
        cache, seen = static["cache"], static["seen"]
        with plain_attention(model):
            started = time.perf_counter()
            token = fill(model, cache, ids[seen:context], chunk)
            prefill_s = time.perf_counter() - started
            warm = 3  # compile / graph capture, outside the timing
            compiled_at = time.perf_counter()
            _, token = greedy_decode(static["model"], cache, token, warm)
            warm_s = time.perf_counter() - compiled_at
            speed, _ = greedy_decode(static["model"], cache, token, tokens)
        static["seen"] = context + warm + tokens
        size = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        return {"kept": context, "prefill tok/s": (context - seen) / prefill_s, "decode tok/s": speed,
                "cache MiB": size / 2**20,
                "note": f"torch.compile {static['options']}; {warm} warm-up steps {warm_s:.1f} s; "
                        f"static cache of {static['length']:,} tokens"}  # fmt: skip

    for context in contexts:
        run(
            VARIANTS[3],
            context,
            lambda context=context: static_row(context),
            scale=2.5 if context == contexts[0] else 1,
        )
    static.clear()
    torch._dynamo.reset()

    def captured_row(context: int) -> dict:
        """h2o on its fixed decode step, the one-token forward captured once by `CompiledStep` (inductor; a
        CUDA graph on a GPU) and replayed; prefill on the torch path like the other h2o rows."""
        from h2o_cli.compiled import CompiledStep, compile_options

        cache, token, prefill_s = h2o_filled(context)
        options = {"backend": "eager"} if dry else compile_options(torch.device(device))
        step = CompiledStep(model, cache, **options)  # UsageError (the row's note) where the step cannot run
        warm = 3  # compile / graph capture, outside the timing
        compiled_at = time.perf_counter()
        for _ in range(warm):
            token = int(step(token).argmax())
        warm_s = time.perf_counter() - compiled_at
        started = time.perf_counter()
        for _ in range(tokens):
            token = int(step(token).argmax())
        speed = tokens / (time.perf_counter() - started)
        torch._dynamo.reset()  # each context's cache has its own shapes: its own graph
        return {"kept": h2o_budget(context, args.fraction), "prefill tok/s": context / prefill_s,
                "decode tok/s": speed, "cache MiB": cache.nbytes() / 2**20,
                "note": f"CompiledStep {options}; {warm} warm-up steps {warm_s:.1f} s"}  # fmt: skip

    for context in contexts:
        run(VARIANTS[4], context, lambda context=context: captured_row(context), scale=2.5)

    for context in contexts:  # before the 4-bit rows, which quantise the model in place
        run(VARIANTS[6], context, lambda context=context: h2o_row(context, VARIANTS[6], policy="recall"))

    def quantized() -> dict:
        quantize_4bit(model, dtype)
        return {"note": "weights quantised to nf4 (bitsandbytes Linear4bit)"}

    quant_rows: list[dict] = [{"note": "skipped: the bench's time was spent"}]
    if left() >= 5:
        quant_rows.clear()
        guarded("quantize 4-bit", limit(), quantized, quant_rows, {"variant": "quantize"})
    if quant_rows[0].get("note", "").startswith(("failed", "skipped")):
        for context in contexts:
            rows.append({"variant": VARIANTS[5], "context": context, "note": quant_rows[0]["note"]})
    else:
        for context in contexts:
            run(VARIANTS[5], context, lambda context=context: h2o_row(context, VARIANTS[5]))
    shape = {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "heads": config.num_attention_heads,
             "kv_heads": config.num_key_value_heads, "dtype": str(dtype), "device": device}  # fmt: skip
    return rows, {"memory_at_longest": memory, "model": shape}


# ------------------------------------------------------------------------------------------------ report
def cell(value, digits: int = 2) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown(report: dict) -> str:
    lines = [
        f"<!-- {SECTION}:begin -->",
        f"Generated by `{report['command']}` on {report['device']} ({report['versions']}), {report['date']}."
        + (
            " **Dry run: a tiny random model on the CPU; the figures measure nothing.**"
            if report["dry_run"]
            else ""
        ),
        "",
        "Per attention call (ms, CUDA events on a GPU): fused = the Triton kernel, torch = `h2o_kernels.decode` / "
        "`.prefill` in torch ops (what `--kernels auto` runs), SDPA = no scores, no rotation.",
        "",
        "| call | shape | slots | fused Triton | torch | SDPA |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["kernels"]:
        lines.append(f"| {row['kind']} | {row['shape']} | {row['slots']:,} | {cell(row.get('fused'), 3)} | "
                     f"{cell(row.get('torch'), 3)} | {cell(row.get('sdpa'), 3)} |")  # fmt: skip
    model = report.get("model") or {}
    lines += [
        "",
        f"Random-weight Llama-2-7B shape ({model.get('layers')} layers, hidden {model.get('hidden')}, "
        f"{model.get('heads')} heads / {model.get('kv_heads')} KV heads, {model.get('dtype')} on "
        f"{model.get('device')}): each context read in chunks of {report['chunk']}, then {report['tokens']} greedy "
        f"decode tokens (`h2o_cli.bench_speed.greedy_decode`); h2o keeps {report['fraction']:.0%} of the context. "
        "Peak GPU memory is `torch.cuda.max_memory_allocated` over the row (weights included), reset per row; "
        "plain rows top one cache up from context to context, so their prefill covers the new tokens only. "
        "Cache MiB: the cache's own buffers (h2o: `H2OCache.nbytes()`, the budget plus spare slots for one "
        "prefill chunk, with scores and bookkeeping; plain: its K and V).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in report["rows"]:
        values = [cell(row.get("variant")), cell(row.get("context")), cell(row.get("kept")),
                  cell(row.get("prefill tok/s"), 0), cell(row.get("decode tok/s")),
                  cell(row.get("peak GPU GiB")), cell(row.get("cache MiB"), 2), cell(row.get("note"))]  # fmt: skip
        lines.append("| " + " | ".join(values).replace("\n", " ") + " |")
    memory = report.get("memory_at_longest") or {}
    if memory:
        parts = [f"{name} {size / 2**20:,.1f} MiB" for name, size in memory.items()]
        full = memory.get("full KV (DynamicCache)")
        ratios = [f"{name} = {size / full:.3f} of the full KV" for name, size in memory.items() if full and name != "full KV (DynamicCache)"]  # fmt: skip
        lines += ["", f"Cache memory at context {report['contexts'][-1]:,}: " + "; ".join(parts)
                  + (" (" + "; ".join(ratios) + ")" if ratios else "") + "."]  # fmt: skip
    lines.append(f"<!-- {SECTION}:end -->")
    return "\n".join(lines)


def environment() -> tuple[str, str]:
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (no GPU)"
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "none"
    return (
        device,
        f"torch {torch.__version__}, transformers {transformers.__version__}, Triton {triton_version}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every row on a tiny model on the CPU")
    parser.add_argument("--only", default="kernels,model", help="parts to run: kernels, model")
    parser.add_argument(
        "--contexts", default=None, help="comma-separated (default 4096,16384,32768; dry 64,128)"
    )
    parser.add_argument("--tokens", type=int, default=None, help="decode tokens per row (default 64; dry 4)")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 1024; dry 32)")
    parser.add_argument("--fraction", type=float, default=0.1, help="h2o's budget, a fraction of the context")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="the model part's dtype (default auto: bfloat16 on a GPU, float32 on the CPU)",
    )
    parser.add_argument("--row-limit", type=float, default=None, help="seconds per row (default 60; dry 60)")
    parser.add_argument("--kernel-limit", type=float, default=30.0, help="seconds per kernel cell")
    parser.add_argument("--kernel-time", type=float, default=60.0, help="seconds for the kernel part in all")
    parser.add_argument(
        "--deadline", type=float, default=330.0, help="seconds from the start after which no model row starts"
    )
    parser.add_argument("--write", default=None, help="markdown file whose GPU section is replaced")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    dry = args.dry_run
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    sys.path[:0] = [str(REPO), str(REPO / "kernels")]
    contexts = [int(c) for c in (args.contexts or ("64,128" if dry else "4096,16384,32768")).split(",")]
    args.tokens = args.tokens or (4 if dry else 64)
    args.chunk = args.chunk or (32 if dry else 1024)
    args.row_limit = args.row_limit or 60.0
    parts = set(args.only.split(","))

    import torch

    if dry:
        torch.set_num_threads(1)
    device, versions = environment()
    report = {
        "command": "python scripts/gpu_bench.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip(),
        "device": device, "versions": versions, "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "dry_run": dry, "contexts": contexts, "tokens": args.tokens, "chunk": args.chunk,
        "fraction": args.fraction, "kernels": [], "rows": [],
    }  # fmt: skip
    if "kernels" in parts:
        report["kernels"] = kernel_rows(dry, args.kernel_limit, started + args.kernel_time)
    if "model" in parts:
        report["rows"], extra = model_rows(args, contexts, started + args.deadline)
        report.update(extra)
    text = markdown(report)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    if args.write:
        from h2o_cli.bench import write_section

        write_section(Path(args.write), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
