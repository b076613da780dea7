"""The depths of one passkey haystack, the text before their needles read once: a forked process per depth."""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import replace

import torch

from h2o_cli.eval import passkey


def answers_forked(
    model,
    tokenizer,
    settings,
    texts: list[tuple[int, str]],
    question: str = passkey.QUESTION,
    most: int | None = None,
):
    """For each (depth, text) of one haystack (the same essays, the needle at each depth), in depth order:
    (depth, answer, prompt tokens, seconds) as `passkey.answer` gives them for `question` (answers of at most
    `most` tokens, as there), but the text before the needles is read once.

    One cache reads the deepest depth's prompt. At the last chunk boundary that a shallower prompt shares with
    it, the process forks (`os.fork`: the child holds an exact copy of the cache, model and all); the child reads
    that prompt's own rest and answers while the parent waits, then the parent reads on. The archive is kept in
    RAM, which a fork copies (a file archive would be one file for both; it recalls bit for bit what a RAM
    archive does). `seconds` is a run's own: the reading up to its fork plus its rest, not the other runs'.
    The cache's `span` is the longest prompt's (`answer` sizes it by its own prompt: this bounds the archive's
    capacity, alike for every depth once the prompts pass `archive_max`). Needs one thread: a forked child
    has no OpenMP pool (`ValueError` otherwise)."""
    from h2o_cli.cache import H2OCache
    from h2o_cli.streaming import prefill

    questions = (question,)

    def prompt(text: str) -> tuple[list[int], list[int]]:  # (frame head + text, the question's NewChunk)
        *read, asked = passkey.prompt_pieces(tokenizer, text, question)
        return [token for piece in read for token in piece], asked

    def rest(read: list[int], asked: list[int], text: str) -> str:
        """A run's own reading (the rest of its text, then the question) and its answer."""
        logits, stats = prefill(model, cache, [read, asked], settings.chunk)
        stats.reraise()
        return passkey.ask(model, tokenizer, cache, logits, text, questions, settings.chunk, most)[0]

    threads = torch.get_num_threads()
    if threads != 1:  # a forked child's first parallel region would wait forever on the parent's thread pool
        raise ValueError(f"forked runs need one thread (torch.set_num_threads(1)), not {threads}")
    prompts = {depth: prompt(text) for depth, text in texts}
    trunk = prompts[max(prompts)][0]
    span = passkey.cache_span(
        max(len(read) + len(asked) for read, asked in prompts.values()), questions, most
    )
    started = time.perf_counter()
    cache = H2OCache(model, replace(settings, archive="ram"), span=span)
    done, reading = 0, time.perf_counter() - started  # trunk tokens read, and the seconds that took
    for depth, text in sorted(texts):
        read, asked = prompts[depth]
        same = next((i for i, (a, b) in enumerate(zip(read, trunk, strict=False)) if a != b), len(read))
        shared = same // settings.chunk * settings.chunk  # whole chunks that both read alike
        if shared < done:  # (the same depth twice) nothing shared left: read it alone
            yield depth, *passkey.answer(model, tokenizer, settings, text, questions, most=most)
            continue
        if shared > done:
            began = time.perf_counter()
            _, stats = prefill(model, cache, [trunk[done:shared]], settings.chunk)
            stats.reraise()
            done, reading = shared, reading + time.perf_counter() - began
        began = time.perf_counter()
        if read is trunk:  # the deepest: the parent reads its rest itself, last
            said = rest(read[shared:], asked, text)
        else:
            try:
                said = in_fork(functools.partial(rest, read[shared:], asked, text))
            except RuntimeError as error:  # the child failed; the parent's cache is as it was
                said = f"{passkey.FAILED}{error}"
        yield depth, said, len(read) + len(asked), reading + time.perf_counter() - began


def in_fork(work):
    """`work()` run in a forked child process; its (JSON) result comes back through a pipe. A child that fails
    raises `RuntimeError` here with its error; the parent's state is never touched by it."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send, and leave without the parent's exit handlers (archive files, atexit)
        os.close(reader)
        try:
            result = {"value": work()}
        except BaseException as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        with os.fdopen(writer, "w") as out:
            json.dump(result, out)
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as source:
        sent = source.read()
    _, status = os.waitpid(pid, 0)
    if not sent:
        raise RuntimeError(f"the forked run ended without an answer (wait status {status})")
    result = json.loads(sent)
    if "error" in result:
        raise RuntimeError(result["error"])
    return result["value"]
