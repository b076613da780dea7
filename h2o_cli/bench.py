"""`h2o bench` measurements: decode speed vs full cache, policy overhead, flat cost of a stream, prefill memory.

Every ratio compares figures measured in the same run, on the same model and thread setting.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from h2o_cli.cache import H2OCache
from h2o_cli.runtime import context_window, make_settings, peak_rss_bytes
from h2o_cli.streaming import chunks_of, forward_chunk, prefill

BOOK = Path("gutenberg_books/war_and_peace_pg2600.txt")  # under the data folder (`--data-dir`, $H2O_DATA)
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


@dataclass
class BenchPlan:
    """What to measure. `quick` shrinks every size so the whole run takes a few minutes."""

    contexts: tuple[int, ...] = (1024, 4096, 8000)
    fractions: tuple[float, ...] = (0.1, 0.2)
    decode_tokens: int = 32
    flat_points: tuple[int, int] = (10_000, 100_000)
    flat_window: int = 512
    flat_budget: int = 1024
    prefill_tokens: int = 8000
    chunk: int = 256

    @classmethod
    def quick(cls) -> BenchPlan:
        return cls(contexts=(1024,), decode_tokens=16, flat_points=(1_000, 4_000), flat_window=256,
                   flat_budget=256, prefill_tokens=2048)  # fmt: skip


@dataclass
class BenchReport:
    threads: int
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def current_rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def book_ids(tokenizer, count: int, path: Path) -> list[int]:
    """`count` token ids of a book, looping it when it is shorter."""
    ids = tokenizer(path.read_text(encoding="utf-8"))["input_ids"]
    return (ids * (count // len(ids) + 1))[:count]


def decode_speed(
    model, ids: list[int], context: int, policy: str, budget: str, tokens: int, chunk: int
) -> float:
    """Tokens/s of token-by-token decode after reading `context` tokens (prefill not timed)."""
    cache = H2OCache(model, make_settings(model, budget, policy, chunk=chunk))
    prefill(model, cache, [ids[:context]], chunk)[1].reraise()
    started = time.perf_counter()
    for token in ids[context : context + tokens]:
        forward_chunk(model, cache, [token])
    return tokens / (time.perf_counter() - started)


def flat_cost(model, ids: list[int], points: tuple[int, int], window: int, budget: int, chunk: int) -> dict:
    """ms/token and RSS over a window of `window` tokens ending at each of `points` in one chunked stream."""
    cache = H2OCache(model, make_settings(model, str(budget), "h2o", chunk=chunk))
    marks = [(0, time.perf_counter(), current_rss_bytes())]  # (tokens done, time, rss) at each chunk boundary
    for piece in chunks_of([ids], chunk, max(points)):
        forward_chunk(model, cache, piece)
        marks.append((marks[-1][0] + len(piece), time.perf_counter(), current_rss_bytes()))
    figures = {}
    for point in points:
        end = next(m for m in marks if m[0] >= point)
        start = max((m for m in marks if m[0] <= end[0] - window), key=lambda m: m[0])
        figures[point] = {"ms_per_token": (end[1] - start[1]) / (end[0] - start[0]) * 1e3, "rss": end[2]}
    return figures


def _prefill_peak(args) -> int:
    name, book, count, chunk, threads = args
    from h2o_cli.models import load_model

    torch.set_num_threads(threads)
    model, tokenizer = load_model(name)
    ids = book_ids(tokenizer, count, book)
    cache = H2OCache(model, make_settings(model, "0.5", "h2o", chunk=chunk))
    base = current_rss_bytes()
    prefill(model, cache, [ids], chunk)[1].reraise()
    return peak_rss_bytes() - base


def prefill_peak(name: str, book: Path, count: int, chunk: int, threads: int) -> int:
    """Peak RSS growth (bytes) of prefilling `count` tokens of `book` in chunks of `chunk`, in a fresh process."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_prefill_peak, ((name, book, count, chunk, threads),))


def llama_cpp_speed(gguf: Path | None, context: int, tokens: int, threads: int) -> float | None:
    """Decode tokens/s of the same GGUF under llama.cpp, or None when llama-cpp-python is not installed."""
    if gguf is None or importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    llm = Llama(str(gguf), n_ctx=((context + tokens) // 256 + 1) * 256, n_threads=threads, verbose=False)
    prompt = llm.tokenize(b" the" * context)[:context]
    llm.eval(prompt)
    started = time.perf_counter()
    for _ in range(tokens):
        llm.eval([llm.sample()])
    return tokens / (time.perf_counter() - started)


def run(
    model, tokenizer, name: str, plan: BenchPlan, book: Path, gguf: Path | None = None, progress=print
) -> BenchReport:
    """Every measurement of `plan` on `model`, reading `book` (a long plain-text file)."""
    threads = torch.get_num_threads()
    report = BenchReport(threads=threads)
    window = context_window(model)
    ids = book_ids(tokenizer, max(max(plan.contexts) + plan.decode_tokens, max(plan.flat_points)), book)
    for context in plan.contexts:
        context = min(context, window - plan.decode_tokens)
        progress(f"decode at context {context}")
        full = decode_speed(model, ids, context, "full", "1", plan.decode_tokens, plan.chunk)
        report.rows.append(
            {"what": f"decode tok/s, context {context}", "setting": "full cache", "value": full}
        )
        for fraction in plan.fractions:
            budget = str(max(2, int(context * fraction)))
            h2o = decode_speed(model, ids, context, "h2o", budget, plan.decode_tokens, plan.chunk)
            local = decode_speed(model, ids, context, "local", budget, plan.decode_tokens, plan.chunk)
            report.rows += [
                {"what": f"decode tok/s, context {context}", "setting": f"h2o {fraction:.0%} ({budget})",
                 "value": h2o, "ratio": h2o / full, "ratio_of": "full"},
                {"what": f"policy overhead, context {context}", "setting": f"h2o vs local, budget {budget}",
                 "value": local / h2o - 1, "unit": "fraction", "goal": "<= 0.05"},
            ]  # fmt: skip
    progress(f"flat cost to token {max(plan.flat_points)}")
    flat = flat_cost(model, ids, plan.flat_points, plan.flat_window, plan.flat_budget, plan.chunk)
    first, last = plan.flat_points
    for point in plan.flat_points:
        report.rows.append({"what": f"stream ms/token at token {point}", "setting": f"h2o {plan.flat_budget}",
                            "value": flat[point]["ms_per_token"], "rss_mib": flat[point]["rss"] / 2**20})  # fmt: skip
    report.rows.append({"what": f"flat cost: time ratio token {last} / {first}", "setting": "goal <= 1.1",
                        "value": flat[last]["ms_per_token"] / flat[first]["ms_per_token"],
                        "rss_ratio": flat[last]["rss"] / flat[first]["rss"]})  # fmt: skip
    report.notes.append(
        f"flat cost measured at tokens {first} and {last} (not 1M): the token count is --flat-to"
    )
    progress(f"prefill peak memory, {plan.prefill_tokens} tokens")
    one_shot = prefill_peak(name, book, plan.prefill_tokens, plan.prefill_tokens, threads)
    chunked = prefill_peak(name, book, plan.prefill_tokens, plan.chunk, threads)
    report.rows += [
        {"what": f"prefill peak RSS growth, {plan.prefill_tokens} tokens", "setting": "one shot",
         "value": one_shot / 2**20, "unit": "MiB"},
        {"what": f"prefill peak RSS growth, {plan.prefill_tokens} tokens", "setting": f"chunks of {plan.chunk}",
         "value": chunked / 2**20, "unit": "MiB", "ratio": chunked / max(one_shot, 1), "ratio_of": "one shot"},
    ]  # fmt: skip
    context = plan.contexts[0]
    cpp = llama_cpp_speed(gguf, context, plan.decode_tokens, threads)
    if cpp is None:
        report.notes.append("llama.cpp: llama-cpp-python not installed (or no GGUF file): not measured")
    else:
        ours = next(r["value"] for r in report.rows if r["setting"] == "full cache")
        report.rows.append({"what": f"llama.cpp decode tok/s, context {context}", "setting": "same GGUF",
                            "value": cpp, "ratio": ours / cpp, "ratio_of": "ours (full) / llama.cpp"})  # fmt: skip
    return report


def markdown(report: BenchReport, command: str) -> str:
    lines = [
        BEGIN,
        f"Generated by `{command}` — torch threads: {report.threads}; another process may share the CPU.",
        "",
        "| measurement | setting | value | ratio |",
        "|---|---|---|---|",
    ]
    for row in report.rows:
        ratio = f"{row['ratio']:.2f} of {row['ratio_of']}" if "ratio" in row else ""
        if "rss_mib" in row:
            ratio = f"RSS {row['rss_mib']:,.0f} MiB"
        if "rss_ratio" in row:
            ratio = f"RSS ratio {row['rss_ratio']:.3f}"
        lines.append(
            f"| {row['what']} | {row['setting']} | {row['value']:,.3f} {row.get('unit', '')} | {ratio} |"
        )
    lines += ["", *[f"- {note}" for note in report.notes], END]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace the text between the bench markers of `path` (append the section if there are none)."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n\n"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
