"""`h2o stream FILE|-`: perplexity of a whole text in constant memory, or read it and answer."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from h2o_cli.cli import options as opt
from h2o_cli.cli.common import load, size, stderr
from h2o_cli.cli.stream_saved import answer_from, run_resumed, save_read
from h2o_cli.config import CacheSettings
from h2o_cli.errors import InputError, UsageError
from h2o_cli.saved_read import QUESTION_ROOM

# a recall stream of a file up to this size counts its tokens first, to size the archive to the text
COUNT_BYTES = 16 * 2**20

EXAMPLES = """
Examples:

  h2o stream --sample --ppl --budget 0.1
  h2o stream --sample --ppl --policy sink --max-tokens 20000 --json
  h2o stream --sample --policy recall --max-tokens 8000 --prompt "Who wrote this book?"
  cat book.txt | h2o stream - --ppl --budget 512 --policy sink --json
  h2o stream book.txt --ppl --quant 4bit --kv-bits 8
  h2o stream book.txt --ppl --budget 410 --score-decay 0.995 --h2o-sinks 4 --json
  h2o stream book.txt --ppl --policy recall --budget 512 --archive disk --archive-bits 8 --archive-max 1GiB
  h2o stream book.txt --policy recall --budget 819 --save book.read
  h2o stream --resume book.read --prompt "Who wrote this book?"
"""


def _progress(total_bytes: int | None):
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn() if total_bytes else TextColumn(""),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=stderr,
        transient=False,
        disable=not sys.stderr.isatty(),
    )


def _tracked(progress, task, source_file, total_bytes: int | None):
    """The file as read through the progress bar (rich advances `task` by the bytes read); stdin as it is:
    with no size to go to, its bar only pulses."""
    return source_file if total_bytes is None else progress.wrap_file(source_file, total_bytes, task_id=task)


@opt.cache_options(budget=opt.DEFAULTS["budget"], chunk=opt.DEFAULTS["chunk"])
def stream(
    context: typer.Context,
    settings: CacheSettings,
    source: Annotated[
        str | None,
        typer.Argument(metavar="FILE", help="Text file to read, or - for stdin.", show_default=False),
    ] = None,
    sample: Annotated[
        bool,
        typer.Option(
            "--sample", help="Read the text shipped with h2o (Frankenstein, public domain) instead of FILE."
        ),
    ] = False,
    ppl: Annotated[bool, typer.Option("--ppl", help="Report the perplexity of the text.")] = False,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens",
            min=1,
            help="Read only the first N tokens of the text (a --prompt is asked after them).",
        ),
    ] = None,
    prompt: Annotated[
        str | None, typer.Option("--prompt", help="Question to answer after reading the text.")
    ] = None,
    model: opt.Model = opt.DEFAULTS["model"],
    quant: opt.Quant = "none",
    max_new_tokens: opt.MaxNewTokens = 128,
    temperature: opt.Temperature = 0.0,
    top_p: opt.TopP = 1.0,
    seed: opt.Seed = None,
    as_json: opt.Json = False,
    device: opt.Device = "auto",
    device_map: opt.DeviceMap = None,
    dtype: opt.Dtype = "auto",
    threads: opt.Threads = 0,
    trust_remote_code: opt.TrustRemoteCode = False,
    compiled: opt.Compile = False,
    save: Annotated[
        Path | None,
        typer.Option(
            "--save",
            help="After reading the text, save the cache's whole state (slots, archive, settings) to this "
            "folder, to ask about the text later with --resume without reading it again.",
            show_default=False,
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            help="Answer --prompt from a read saved with --save (give no FILE): the save is read, not "
            "changed, so each question starts from the same read. Cache options must be the saved ones.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Stream a whole text through the H2O cache in constant memory.

    With --ppl, report its perplexity; otherwise read it and then generate (answer --prompt, or continue
    the text). The perplexity line or the generated text goes to stdout; progress and figures to stderr.
    For perplexity over long running text `--policy sink` measured lower than `h2o`; to ask about the text
    afterwards, `--policy recall` keeps what `h2o` forgets (docs/results.md).
    """
    from h2o_cli.cache import H2OCache
    from h2o_cli.generation import Sampling
    from h2o_cli.models import context_window
    from h2o_cli.models.precision import matmul_precision
    from h2o_cli.textio import open_source

    started = time.perf_counter()
    sampling = Sampling(max_new_tokens, temperature, top_p, seed)
    if resume is not None:
        if source is not None or sample or ppl or max_tokens is not None or save is not None:
            raise UsageError(
                "--resume answers from a saved read: give no FILE, --sample, --ppl, --max-tokens, --save"
            )
        if prompt is None:
            raise UsageError("--resume answers a question about the saved text: give it with --prompt")
        options = dict(device=device, device_map=device_map, dtype=dtype, threads=threads, quant=quant)
        report = run_resumed(
            context,
            settings,
            resume,
            prompt,
            model,
            sampling,
            as_json,
            compiled,
            started,
            options,
            trust_remote_code,
        )
        if as_json:
            print(json.dumps(report))
        return
    if save is not None and ppl:
        raise UsageError("--save keeps a read to ask about later; it does not take --ppl")
    source = _source(source, sample)
    source_file = open_source(source)  # fail on a bad path before loading a model
    total_bytes = None
    if source != "-":
        total_bytes = source_file.seek(0, 2)
        source_file.seek(0)
        if total_bytes == 0:
            raise InputError(f"{source} is empty; give a text with at least two tokens")
    from h2o_cli.policies import policy_class

    lm, tokenizer = load(model, device, dtype, trust_remote_code, threads, quant, device_map)
    # the most tokens the text holds: one a byte, or counted (what sizes recall's archive)
    text_bound = total_bytes
    if policy_class(settings.policy).recalls and total_bytes is not None and total_bytes <= COUNT_BYTES:
        text_bound = _text_tokens(source_file, tokenizer)
    spans = {"archive_span": _span(max_tokens, text_bound, prompt, sampling)}
    if save is not None:  # room for the questions asked later, whatever this run's --prompt
        spans["archive_span"] = _span(max_tokens, text_bound, None, sampling)
        spans["archive_span"] = spans["archive_span"] and spans["archive_span"] + QUESTION_ROOM
    cache = H2OCache(lm, settings.resolved(context_window(lm)), **spans)
    chunk = settings.chunk
    step = _compiled_step(lm, cache, ppl and chunk > 1) if compiled else None
    arguments = (source_file, source, total_bytes, max_tokens, chunk, prompt, sampling, as_json, step)
    if ppl:
        report = _run_ppl(lm, tokenizer, cache, *arguments)
    else:
        saving = None if save is None else {"path": save, "model": model, "spans": spans}
        report = _run_generate(lm, tokenizer, cache, *arguments, saving=saving, started=started)
    report["model"] = model
    report |= matmul_precision(lm)  # which dtype the linear layers multiplied in, reading and decoding
    if as_json:
        print(json.dumps(report))
    if report.get("error"):
        raise InputError(report["error"])


def _text_tokens(source_file, tokenizer) -> int:
    """The tokens of a file the stream then reads (`token_stream`'s ids, so the same count), the file left at
    its start; a file that is not UTF-8 counts as its bytes (the stream reads its valid part, then says why)."""
    from h2o_cli.textio import text_blocks, token_stream

    source_file.seek(0)
    try:
        return sum(map(len, token_stream(tokenizer, text_blocks(source_file))))
    except InputError:
        return source_file.seek(0, 2)
    finally:
        source_file.seek(0)


def _span(max_tokens: int | None, text_bound: int | None, prompt: str | None, sampling) -> int | None:
    """The most tokens the cache can meet when that is known before reading (None: stdin without
    --max-tokens): the text's tokens (at most --max-tokens, at most `text_bound`: the file's bytes, or its
    counted tokens), the question (at most one per byte) with its frame, and the answer. A recall archive is
    then no larger than the text."""
    text = min(bound for bound in (max_tokens, text_bound, float("inf")) if bound is not None)
    if text == float("inf"):
        return None
    asked = len(prompt.encode()) + 256 + sampling.max_new_tokens if prompt else 0
    return int(text) + asked


def _compiled_step(lm, cache, chunked: bool):
    """`--compile`: the captured one-token forward (h2o_cli.compiled); a note when the stream feeds chunks."""
    from h2o_cli.compiled import CompiledStep

    if chunked:
        stderr.print("[yellow]note:[/] --compile captures one-token calls; --ppl feeds them with --chunk 1")
    return CompiledStep(lm, cache)


def _source(source: str | None, sample: bool) -> str:
    """FILE, `-`, or the shipped sample's path with --sample (exactly one of them)."""
    if sample and source is not None:
        raise UsageError("give FILE or --sample, not both")
    if sample:
        from h2o_cli.data import SAMPLE_TEXT

        return str(SAMPLE_TEXT)
    if source is None:
        raise UsageError("give a text file, - for stdin, or --sample for the text shipped with h2o")
    return source


def _pieces(tokenizer, reader, source: str):
    from h2o_cli.textio import text_blocks, token_stream

    return token_stream(tokenizer, text_blocks(reader, name="stdin" if source == "-" else source))


def _run_ppl(
    lm, tokenizer, cache, source_file, source, total_bytes, max_tokens, chunk, prompt, sampling, quiet, step
) -> dict:
    from h2o_cli.runtime import cache_summary, peak_rss_bytes
    from h2o_cli.streaming import stream_perplexity

    if prompt is not None:
        stderr.print("[yellow]note:[/] --prompt is ignored with --ppl")
    with _progress(total_bytes) as progress:
        task = progress.add_task("stream", total=total_bytes, status="")
        reader = _tracked(progress, task, source_file, total_bytes)

        def update(stats) -> None:
            status = f"{stats.tokens:,} tok  {stats.tokens_per_s:,.0f} tok/s  ppl {stats.ppl:.3f}  "
            status += f"cache {size(cache.nbytes())}"
            progress.update(task, status=status)

        pieces = _pieces(tokenizer, reader, source)
        stats = stream_perplexity(lm, cache, pieces, chunk, max_tokens, update, step)
    if stats.predictions == 0 and not stats.error:
        raise InputError(f"{source} has fewer than two tokens; perplexity needs at least one prediction")
    report = {
        "ppl": stats.ppl,
        "nll": stats.mean_nll,
        "tokens": stats.tokens,
        "predictions": stats.predictions,
        **cache_summary(cache),
        "tokens_per_s": stats.tokens_per_s,
        "seconds": stats.seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "interrupted": stats.interrupted,
    }
    if stats.error:
        report["error"] = stats.error
    partial = (
        " (interrupted: partial)"
        if stats.interrupted
        else (" (stopped early: partial)" if stats.error else "")
    )
    if not quiet:  # the result is data: stdout; with --json the JSON object carries it instead
        print(f"perplexity {stats.ppl:.4f} over {stats.predictions:,} predictions{partial}", flush=True)
    windows = (  # sliding-window layers (Gemma 3) hold their window beside the budget
        f"; {report['windowed_layers']} window layers hold {report['window_slots']} slots each"
        if report.get("windowed_layers")
        else ""
    )
    stderr.print(
        f"{stats.tokens_per_s:,.1f} tok/s · cache {size(report['kv_cache_bytes'])}"
        f" ({report['policy']}, {report['budget_tokens']} tokens{windows})"
        f" · peak RSS {size(report['peak_rss_bytes'])}"
    )
    return report


def _run_generate(
    lm,
    tokenizer,
    cache,
    source_file,
    source,
    total_bytes,
    max_tokens,
    chunk,
    prompt,
    sampling,
    quiet,
    step,
    saving=None,
    started=0.0,
) -> dict:
    from h2o_cli.prompting import read_then_answer
    from h2o_cli.runtime import cache_summary
    from h2o_cli.saved_read import question_pieces, text_pieces
    from h2o_cli.streaming import prefill

    with _progress(total_bytes) as progress:
        task = progress.add_task("read", total=total_bytes, status="")
        pieces = _pieces(tokenizer, _tracked(progress, task, source_file, total_bytes), source)
        if saving is not None:  # a save holds the text; a question is read after it, as a chunk of its own
            pieces, max_tokens = text_pieces(tokenizer, pieces, max_tokens), None
        elif prompt is not None:  # --max-tokens cuts the text; the question is always asked after it
            pieces, max_tokens = read_then_answer(tokenizer, pieces, prompt, max_tokens), None

        def update(stats) -> None:
            progress.update(task, status=f"{stats.tokens:,} tok  {stats.tokens_per_s:,.0f} tok/s")

        logits, stats = prefill(lm, cache, pieces, chunk, max_tokens, update)
    if stats.interrupted or stats.error:  # a partial read: report it, answer nothing
        stderr.print(
            f"read {stats.tokens:,} tokens before {'Ctrl-C' if stats.interrupted else 'an error'}; no answer"
        )
        report = {
            "answer": None,
            "tokens": stats.tokens,
            "interrupted": stats.interrupted,
            **cache_summary(cache),
        }
        return report | ({"error": stats.error} if stats.error else {})
    saved = {}
    if saving is not None:
        saved = save_read(lm, cache, source, saving)
        if prompt is None:
            return {"answer": None, "tokens": stats.tokens, **saved, **cache_summary(cache)}
        logits, asked = prefill(lm, cache, question_pieces(tokenizer, prompt), chunk)
        asked.reraise()
    if logits is None:
        raise InputError(f"{source} is empty; give a text to read")
    answer = answer_from(lm, tokenizer, cache, logits, sampling, step, quiet, started)
    return {
        **answer,
        "tokens": stats.tokens,
        **saved,
        **cache_summary(cache),
        "prefill_tokens_per_s": stats.tokens_per_s,
    }


stream.__doc__ = (stream.__doc__ or "") + EXAMPLES
