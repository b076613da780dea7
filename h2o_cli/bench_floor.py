"""How far each phase is from the hardware's limits: the floors `h2o bench` prints beside the measured speeds.

Reading (chunks of `chunk` tokens) is bound by the matmuls of the model's linear layers: timing every linear
shape of the model once at `chunk` rows (the best of a few calls each) gives the time of one chunk's matmuls,
hence a read ceiling of `chunk / seconds` tokens/s and the GFLOPS it ran at. Decoding (one row) is bound by the
bytes it reads: every weight once, plus the K/V of the resident tokens (`bench_speed.ByteModel`); over the copy
bandwidth measured in the same run that gives a decode ceiling. The matmuls at one row give a second decode
ceiling (what the linear layers alone allow, their weights coming from memory as in a forward: each shape
cycles through copies of more bytes than a cache holds). llama.cpp on the same GGUF, when llama-cpp-python is installed, reads and decodes the same context.

Arithmetic (every figure is recomputed from the timings and shapes in `tests/test_bench_parts.py`):
    matmul seconds(rows) = Σ over shapes of count × best seconds of one `linear(rows × in, out × in)`
    GFLOPS(rows)         = 2 × rows × Σ count × in × out / matmul seconds(rows) / 1e9
    read ceiling         = chunk / matmul seconds(chunk)           tokens/s
    decode matmul ceil.  = 1 / matmul seconds(1)                   tokens/s
    decode byte ceiling  = bandwidth / bytes per token(budget)     tokens/s
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from h2o_cli.bench_speed import ByteModel, fill, greedy_decode, h2o_budget
from h2o_cli.cache import H2OCache
from h2o_cli.runtime import make_settings

HOT_BYTES = 64 * 2**20  # one shape's weight copies cycled through: more than a cache holds, as in a forward


def linear_shapes(model) -> list[dict]:
    """The model's linear layers by shape: [{"in", "out", "count"}], one forward's worth (lm_head included)."""
    counts = Counter(
        (module.in_features, module.out_features)
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
    )
    return [{"in": i, "out": o, "count": n} for (i, o), n in sorted(counts.items())]


def time_linear(rows: int, inputs: int, outputs: int, copies: int, dtype, device, repeats: int) -> float:
    """Best seconds of one `linear(x[rows, inputs], w[outputs, inputs])`, cycling `copies` weights so that
    a weight is not read from a cache a forward would not have it in."""
    x = torch.randn(rows, inputs, dtype=dtype, device=device)
    weights = [torch.randn(outputs, inputs, dtype=dtype, device=device) for _ in range(copies)]
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    best = float("inf")
    with torch.inference_mode():
        F.linear(x, weights[0])  # warm-up
        for number in range(repeats * copies):
            sync()
            started = time.perf_counter()
            F.linear(x, weights[number % copies])
            sync()
            best = min(best, time.perf_counter() - started)
    return best


def matmul_times(model, rows: int, repeats: int = 5) -> list[dict]:
    """`linear_shapes(model)` with `seconds`: the best time of one call of each at `rows` rows, on the
    weights' device, in the dtype a call of that many rows multiplies in (`--dtype auto`'s bf16 for a read,
    `h2o_cli.models.precision`; else the weights')."""
    from h2o_cli.models.precision import READ_ROWS

    weight = next(model.parameters())
    read_dtype = getattr(model, "h2o_read_dtype", None)
    dtype = read_dtype if read_dtype is not None and rows >= READ_ROWS else weight.dtype
    out = []
    for shape in linear_shapes(model):
        size = shape["in"] * shape["out"] * dtype.itemsize
        copies = max(1, min(shape["count"], math.ceil(HOT_BYTES / size)))
        seconds = time_linear(rows, shape["in"], shape["out"], copies, dtype, weight.device, repeats)
        out.append({**shape, "seconds": seconds, "dtype": str(dtype).removeprefix("torch.")})
    return out


def matmul_floor(shapes: list[dict], rows: int) -> dict:
    """One forward's matmul seconds at `rows` rows, the GFLOPS and the tokens/s ceiling (`rows` / seconds)."""
    seconds = sum(shape["count"] * shape["seconds"] for shape in shapes)
    flops = 2 * rows * sum(shape["count"] * shape["in"] * shape["out"] for shape in shapes)
    dtype = shapes[0]["dtype"] if shapes else None
    return {
        "rows": rows,
        "seconds": seconds,
        "gflops": flops / seconds / 1e9,
        "ceiling": rows / seconds,
        "dtype": dtype,
    }


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_speeds(gguf: Path | None, context: int, tokens: int, threads: int, batch: int) -> dict | None:
    """llama.cpp on the same GGUF: {"read": prompt-eval tokens/s of `context` tokens in batches of `batch`,
    "decode": tokens/s of `tokens` more}, or None when llama-cpp-python is not installed (or no GGUF)."""
    if gguf is None or not llama_cpp_available():
        return None
    from llama_cpp import Llama

    llm = Llama(str(gguf), n_ctx=((context + tokens) // 256 + 1) * 256, n_threads=threads, n_batch=batch,
                verbose=False)  # fmt: skip
    prompt = (llm.tokenize(b" the" * context) * 2)[:context]
    started = time.perf_counter()
    llm.eval(prompt)
    read = context / (time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(tokens):
        llm.eval([llm.sample()])
    return {"read": read, "decode": tokens / (time.perf_counter() - started)}


def phase_speeds(
    model, ids: list[int], context: int, budget: int, tokens: int, chunk: int, kernels: str, **policy
) -> dict:
    """A cache keeping `budget` tokens (h2o unless `policy="..."`) reading `context` ids in chunks of `chunk`
    and decoding `tokens` greedy tokens after them: {"budget", "read", "decode"} (tokens/s)."""
    cache = H2OCache(model, make_settings(model, str(budget), chunk=chunk, kernels=kernels, **policy))
    started = time.perf_counter()
    token = fill(model, cache, ids[:context], chunk)
    read = context / (time.perf_counter() - started)
    return {"budget": budget, "read": read, "decode": greedy_decode(model, cache, token, tokens)[0]}


def measure(model, ids: list[int], context: int, plan, bandwidth: float, llama: dict | None) -> dict:
    """The floor part's figures (see the module docstring): measured read and decode speeds, the matmul
    timings at `plan.chunk` rows and at one row, the byte ceiling, and llama.cpp's speeds (or None)."""
    budget = h2o_budget(context, plan.speed_fraction)
    speeds = phase_speeds(model, ids, context, budget, plan.decode_tokens, plan.chunk, plan.kernels)
    read_shapes, decode_shapes = matmul_times(model, plan.chunk), matmul_times(model, 1)
    byte_model = ByteModel.of(model)
    bytes_per_token = byte_model.bytes_per_token(speeds["budget"])
    return {
        "context": context, **speeds, "chunk": plan.chunk, "tokens": plan.decode_tokens,
        "read_shapes": read_shapes, "decode_shapes": decode_shapes,
        "read_matmul": matmul_floor(read_shapes, plan.chunk), "decode_matmul": matmul_floor(decode_shapes, 1),
        "bandwidth": bandwidth, "bytes_per_token": bytes_per_token,
        "decode_bytes_ceiling": bandwidth / bytes_per_token, "llama_cpp": llama,
    }  # fmt: skip


def markdown(floor: dict, threads: int) -> list[str]:
    """The floor table of `h2o bench` (lines of markdown)."""
    read, decode, llama = floor["read_matmul"], floor["decode_matmul"], floor["llama_cpp"]
    ceiling = min(decode["ceiling"], floor["decode_bytes_ceiling"])
    lines = [
        f"How far each phase is from the hardware's limits: h2o at budget {floor['budget']} reading "
        f"{floor['context']:,} tokens in chunks of {floor['chunk']}, then decoding {floor['tokens']}; torch "
        f"threads {threads}. Matmul ceiling: the model's linear shapes timed in this run (read: {floor['chunk']} "
        f"rows in {read['dtype']}, {read['gflops']:,.1f} GFLOPS; decode: one row in {decode['dtype']}, "
        f"{decode['gflops']:,.1f} GFLOPS). Byte ceiling: "
        f"{floor['bytes_per_token'] / 1e6:,.1f} MB/token over the copy bandwidth measured in this run, "
        f"{floor['bandwidth'] / 1e9:,.1f} GB/s.",
        "",
        "| phase | ours tok/s | matmul ceiling tok/s | byte ceiling tok/s | ours / ceiling | llama.cpp tok/s "
        "| ours / llama.cpp |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase, ours, matmul, byte, best in (
        ("read", floor["read"], read["ceiling"], None, read["ceiling"]),
        ("decode", floor["decode"], decode["ceiling"], floor["decode_bytes_ceiling"], ceiling),
    ):
        cpp = llama[phase] if llama else None
        lines.append(
            f"| {phase} | {ours:,.1f} | {matmul:,.1f} | {'' if byte is None else f'{byte:,.1f}'} | "
            f"{ours / best:.2f} | {'not measured' if cpp is None else f'{cpp:,.1f}'} | "
            f"{'' if cpp is None else f'{ours / cpp:.2f}'} |"
        )
    return lines
