"""`h2o bench` measurements: h2o vs plain transformers (decode, stream), decode vs our full cache, policy
overhead, flat cost of a stream, prefill memory, llama.cpp; on request, cache settings against each other
(`recall` vs `h2o`: bench_recall), two checkouts' decode side by side (bench_paired) and `h2o stream --ppl` per
policy, chunk and length in fresh processes (bench_streams).

Every ratio compares figures measured in the same run, on the same model and thread setting.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil
import torch

from h2o_cli import bench_floor, bench_paired, bench_recall, bench_speed, bench_streams
from h2o_cli.cache import H2OCache
from h2o_cli.config import parse_budget
from h2o_cli.runtime import context_window, make_settings, peak_rss_bytes
from h2o_cli.streaming import chunks_of, forward_chunk, prefill

BOOK = Path("gutenberg_books/war_and_peace_pg2600.txt")  # under the data folder (`--data-dir`, $H2O_DATA)
PARTS = ("speed", "stream", "floor", "policies", "flat", "prefill", "llama_cpp")  # a plain `h2o bench`
# The bench part that times cache settings against each other (`--only recall`): a part's name, not a policy's.
RECALL_PART = "recall"
ON_REQUEST = (RECALL_PART, "paired", "streams")  # `--only` may choose these too
SKIP_LLAMA_CPP = "llama.cpp: llama-cpp-python not installed (or no GGUF file): not measured"


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
    parts: tuple[str, ...] = PARTS
    speed_fraction: float = 0.1  # h2o's budget against plain transformers, of each context
    rounds: int = 2
    stream_tokens: int = 8000
    kernels: str = "auto"
    budget: str | None = None  # recall, paired: a count, or a fraction of each context (None: speed_fraction)
    runs: bench_recall.RunsPlan = bench_recall.RunsPlan()  # recall: its budget and chunk are set per context
    question: str | None = None  # recall: the read ends with it, as `h2o stream --prompt` asks one
    paired: bench_paired.PairedPlan | None = None  # paired: the two checkouts
    streams: bench_streams.StreamsPlan = bench_streams.StreamsPlan()

    @classmethod
    def quick(cls) -> BenchPlan:
        return cls(contexts=(1024,), decode_tokens=16, flat_points=(1_000, 4_000), flat_window=256,
                   flat_budget=256, prefill_tokens=2048, stream_tokens=1024)  # fmt: skip

    def section(self, threads: int) -> str:
        """Name of the docs section a run of these parts fills: `bench` for all of them, else one per parts and
        thread count (so runs with 1 and 2 threads stand side by side)."""
        return "bench" if set(self.parts) == set(PARTS) else f"bench-{'-'.join(self.parts)}-threads-{threads}"

    def budget_of(self, context: int) -> int:
        """Tokens kept at `context` by the recall and paired parts."""
        return parse_budget(self.budget or str(self.speed_fraction), context)


@dataclass
class BenchReport:
    threads: int
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    speed: list[dict] = field(default_factory=list)  # paired plain/h2o decode, one row per round and context
    stream: dict | None = None
    bandwidth: float | None = None  # bytes/s, copy (read + write)
    byte_model: bench_speed.ByteModel | None = None
    plan: BenchPlan | None = None
    recall: list[dict] = field(default_factory=list)  # per context: {"context", "budget", "rows"}
    paired: list[dict] = field(default_factory=list)  # per context: bench_paired.paired_context's row
    streams: list[dict] = field(default_factory=list)  # per run: `h2o stream --json`'s report
    floor: dict | None = None  # bench_floor.measure's figures


def current_rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def book_ids(tokenizer, count: int, path: Path) -> list[int]:
    """`count` token ids of a book, looping it when it is shorter."""
    ids = tokenizer(path.read_text(encoding="utf-8"))["input_ids"]
    return (ids * (count // len(ids) + 1))[:count]


def decode_speed(
    model,
    ids: list[int],
    context: int,
    policy: str,
    budget: str,
    tokens: int,
    chunk: int,
    kernels: str = "auto",
) -> float:
    """Tokens/s of token-by-token decode after reading `context` tokens (prefill not timed)."""
    cache = H2OCache(model, make_settings(model, budget, policy, chunk=chunk, kernels=kernels))
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


def run(
    model, tokenizer, name: str, plan: BenchPlan, book: Path, gguf: Path | None = None, progress=print
) -> BenchReport:
    """Every measurement of `plan` on `model`, reading `book` (a long plain-text file). `model` may be None
    when the parts are only `paired` (its workers load their own)."""
    threads = torch.get_num_threads()
    report = BenchReport(threads=threads, plan=plan)
    parts = plan.parts
    if "paired" in parts:
        budgets = [plan.budget_of(context) for context in plan.contexts]
        report.paired = bench_paired.paired_decode(plan.paired, plan.contexts, budgets, progress)
    if "streams" in parts:
        report.streams = bench_streams.measure(plan.streams, name, book, threads, progress)
    if model is None or set(parts) <= {"paired", "streams"}:
        return report
    window = context_window(model)
    contexts = tuple(min(context, window - plan.decode_tokens) for context in plan.contexts)
    needed = [max(contexts) + plan.decode_tokens, plan.stream_tokens if "stream" in parts else 0]
    needed += [max(plan.contexts)] if RECALL_PART in parts else []
    ids = book_ids(tokenizer, max(needed + ([max(plan.flat_points)] if "flat" in parts else [])), book)
    if RECALL_PART in parts:
        recall_rows(report, model, tokenizer, ids, plan, progress)
    llama = None
    if "floor" in parts or "llama_cpp" in parts:
        progress(f"llama.cpp read and decode, context {contexts[0]}")
        llama = bench_floor.llama_cpp_speeds(gguf, contexts[0], plan.decode_tokens, threads, plan.chunk)
        if llama is None:
            report.notes.append(SKIP_LLAMA_CPP)
    if {"speed", "stream", "floor"} & set(parts):
        progress("copy bandwidth")
        report.bandwidth = bench_speed.copy_bandwidth(device=model.device)
        report.byte_model = bench_speed.ByteModel.of(model)
    if "speed" in parts:
        report.speed = bench_speed.paired_decode(
            model, ids, contexts, plan.speed_fraction, plan.decode_tokens, plan.rounds, plan.chunk,
            plan.kernels, progress,
        )  # fmt: skip
    if "stream" in parts:
        progress(f"stream --ppl vs plain transformers, {plan.stream_tokens} tokens")
        tokens = min(plan.stream_tokens, window)
        report.stream = bench_speed.stream_speed(model, ids, tokens, plan.chunk, kernels=plan.kernels)
    if "floor" in parts:
        progress(f"floor: read {contexts[0]} tokens, decode {plan.decode_tokens}; the model's matmuls")
        report.floor = bench_floor.measure(model, ids, contexts[0], plan, report.bandwidth, llama)
    if "policies" in parts:
        policy_rows(report, model, ids, contexts, plan, progress)
    if "flat" in parts:
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
    if "prefill" in parts:
        progress(f"prefill peak memory, {plan.prefill_tokens} tokens")
        one_shot = prefill_peak(name, book, plan.prefill_tokens, plan.prefill_tokens, threads)
        chunked = prefill_peak(name, book, plan.prefill_tokens, plan.chunk, threads)
        report.rows += [
            {"what": f"prefill peak RSS growth, {plan.prefill_tokens} tokens", "setting": "one shot",
             "value": one_shot / 2**20, "unit": "MiB"},
            {"what": f"prefill peak RSS growth, {plan.prefill_tokens} tokens", "setting": f"chunks of {plan.chunk}",
             "value": chunked / 2**20, "unit": "MiB", "ratio": chunked / max(one_shot, 1), "ratio_of": "one shot"},
        ]  # fmt: skip
    if "llama_cpp" in parts and llama is not None:
        llama_rows(report, model, ids, contexts[0], plan, llama)
    return report


def llama_rows(
    report: BenchReport, model, ids: list[int], context: int, plan: BenchPlan, llama: dict
) -> None:
    """llama.cpp's read and decode speeds beside our full cache's at the same context."""
    ours = bench_floor.phase_speeds(model, ids, context, context + plan.decode_tokens, plan.decode_tokens,
                                    plan.chunk, plan.kernels, policy="full")  # fmt: skip
    full = next((r["value"] for r in report.rows if r["setting"] == "full cache"), ours["decode"])
    for phase, mine in (("read", ours["read"]), ("decode", full)):
        report.rows.append({"what": f"llama.cpp {phase} tok/s, context {context}", "setting": "same GGUF",
                            "value": llama[phase], "ratio": mine / llama[phase],
                            "ratio_of": "ours (full) / llama.cpp"})  # fmt: skip


def recall_rows(report: BenchReport, model, tokenizer, ids: list[int], plan: BenchPlan, progress) -> None:
    """The runs of `plan.runs` against each other at each context of `ids` (past the context window too: the
    caches roll their positions)."""
    question = tokenizer(plan.question, add_special_tokens=False)["input_ids"] if plan.question else None
    for context in plan.contexts:
        runs = replace(plan.runs, budget=plan.budget_of(context), chunk=plan.chunk)
        rows = bench_recall.measure(model, ids[:context], runs, question, progress)
        report.recall.append({"context": context, "budget": runs.budget, "rows": rows})


def policy_rows(report: BenchReport, model, ids: list[int], contexts, plan: BenchPlan, progress) -> None:
    """Decode against our own full cache, and h2o against local (the policy's own cost), per context."""
    for context in contexts:
        progress(f"decode at context {context}: full, h2o, local")
        full = decode_speed(model, ids, context, "full", "1", plan.decode_tokens, plan.chunk, plan.kernels)
        report.rows.append(
            {"what": f"decode tok/s, context {context}", "setting": "full cache", "value": full}
        )
        for fraction in plan.fractions:
            budget = str(max(2, int(context * fraction)))
            h2o = decode_speed(
                model, ids, context, "h2o", budget, plan.decode_tokens, plan.chunk, plan.kernels
            )
            local = decode_speed(
                model, ids, context, "local", budget, plan.decode_tokens, plan.chunk, plan.kernels
            )
            report.rows += [
                {"what": f"decode tok/s, context {context}", "setting": f"h2o {fraction:.0%} ({budget})",
                 "value": h2o, "ratio": h2o / full, "ratio_of": "full"},
                {"what": f"policy overhead, context {context}", "setting": f"h2o vs local, budget {budget}",
                 "value": local / h2o - 1, "unit": "fraction", "goal": "<= 0.05"},
            ]  # fmt: skip


def markers(section: str) -> tuple[str, str]:
    return f"<!-- {section}:begin -->", f"<!-- {section}:end -->"


def markdown(report: BenchReport, command: str) -> str:
    plan = report.plan or BenchPlan()
    begin, end = markers(plan.section(report.threads))
    lines = [
        begin,
        f"Generated by `{command}` — torch threads: {report.threads}; another process may share the CPU.",
    ]
    if report.speed or report.stream:
        lines += ["", *bench_speed.markdown(
            report.speed, bench_speed.summary(report.speed, report.byte_model, report.bandwidth), report.stream,
            report.byte_model, report.bandwidth, report.threads, plan.decode_tokens, plan.chunk,
            plan.speed_fraction,
        )]  # fmt: skip
    if report.floor is not None:
        lines += ["", *bench_floor.markdown(report.floor, report.threads)]
    for table in report.recall:
        lines += ["", *bench_recall.markdown(table["rows"], table["context"], table["budget"], plan.chunk)]
    if report.paired:
        lines += ["", *bench_paired.markdown(report.paired, plan.paired)]
    if report.streams:
        lines += ["", *bench_streams.markdown(report.streams, plan.streams)]
    if report.rows:
        lines += ["", "| measurement | setting | value | ratio |", "|---|---|---|---|"]
    for row in report.rows:
        ratio = f"{row['ratio']:.2f} of {row['ratio_of']}" if "ratio" in row else ""
        if "rss_mib" in row:
            ratio = f"RSS {row['rss_mib']:,.0f} MiB"
        if "rss_ratio" in row:
            ratio = f"RSS ratio {row['rss_ratio']:.3f}"
        lines.append(
            f"| {row['what']} | {row['setting']} | {row['value']:,.3f} {row.get('unit', '')} | {ratio} |"
        )
    lines += ["", *[f"- {note}" for note in report.notes], end]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace the text between the markers that open and close `section` in `path` (append it if absent)."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n\n"
    begin, end = section.splitlines()[0], section.splitlines()[-1]
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
