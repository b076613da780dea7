"""`h2o stream --save` and `--resume`: a read written to a save, and a question answered from one
(h2o_cli.saved_read)."""

from __future__ import annotations

import sys
import time

from h2o_cli.cli.chat import given_settings, left_default
from h2o_cli.cli.common import load, size, stderr


def save_read(lm, cache, source: str, saving: dict) -> dict:
    """Write the read to `saving["path"]` (locked while written); say so on stderr; the figures for --json."""
    from h2o_cli.saved_checks import SaveLock
    from h2o_cli.saved_read import archive_bytes, save_text_read, text_identity

    lock = SaveLock(saving["path"])
    try:
        written = save_text_read(
            saving["path"], cache, lm, saving["model"], text_identity(source), saving["spans"]
        )
    finally:
        lock.release()
    archive = archive_bytes(cache)
    kept = f" (archive {size(archive)})" if archive else ""
    stderr.print(f"saved the read to {saving['path']}: {size(written)}{kept}", highlight=False)
    return {"save": str(saving["path"]), "save_bytes": written, "save_archive_bytes": archive}


def answer_from(lm, tokenizer, cache, logits, sampling, step, quiet: bool, started: float) -> dict:
    """Generate from `logits`, streaming the text to stdout (unless `quiet`): the answer and its figures;
    `first_token_seconds` counts from `started` (the command's start)."""
    from h2o_cli.generation import TextStreamer, generate_ids
    from h2o_cli.runtime import peak_rss_bytes

    streamer = TextStreamer(tokenizer)
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    decoding, generated, first = time.perf_counter(), 0, None
    try:
        for token in generate_ids(lm, cache, logits, sampling, stop, step):
            generated += 1
            first = first or time.perf_counter() - started
            text = streamer.push(token)
            if not quiet:
                sys.stdout.write(text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    if not quiet:
        sys.stdout.write("\n")
    seconds = time.perf_counter() - decoding
    return {
        "answer": streamer.printed,
        "generated_tokens": generated,
        "first_token_seconds": first,
        "tokens_per_s": generated / seconds if seconds > 0 else 0.0,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def run_resumed(context, settings, path, prompt, model, sampling, quiet, compiled, started, options, trust):
    """`--resume`: open the save (checked before the model loads), build the cache from it, answer."""
    from h2o_cli.compiled import CompiledStep
    from h2o_cli.runtime import cache_summary
    from h2o_cli.saved_checks import resume_settings
    from h2o_cli.saved_read import archive_bytes, open_text_save, question_pieces, resumed_cache
    from h2o_cli.streaming import prefill

    saved = open_text_save(path)
    settings = resume_settings(saved, given_settings(context, settings))  # refused before the model loads
    if left_default(context, "model"):
        model = saved.manifest["model"]["name"]
    lm, tokenizer = load(
        model,
        options["device"],
        options["dtype"],
        trust,
        options["threads"],
        options["quant"],
        options["device_map"],
    )
    cache = resumed_cache(saved, lm, model, settings)
    resumed = time.perf_counter() - started
    step = CompiledStep(lm, cache) if compiled else None
    pieces = question_pieces(tokenizer, prompt)
    logits, stats = prefill(lm, cache, pieces, cache.settings.chunk)
    stats.reraise()
    answer = answer_from(lm, tokenizer, cache, logits, sampling, step, quiet, started)
    saved.verified()  # a damaged archive, found while answering: one line, exit 1
    figures = {"resumed": str(saved.path), "resume_seconds": resumed, "save_bytes": saved.size}
    figures["save_archive_bytes"] = archive_bytes(saved)
    return {**answer, "tokens": saved.extra["tokens"], **figures, **cache_summary(cache), "model": model}
