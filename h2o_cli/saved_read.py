"""Reading a text once and asking later (`h2o stream --save` / `--resume`): how a text is read for a save, and
how a resumed cache is built and asked, so that its answer is the one the reading process gives.

A save holds the whole text read (the document frame's head, the text, cut to `--max-tokens`), and a question
is read after it as a chunk of its own (a `NewChunk`), in the reading process as in a resumed one: so the
calls a resumed cache makes for a question are the reading process's own, token for token, and a resume
reads nothing but the question (docs/design.md, "How is a read saved, and why can a question not change it?").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from h2o_cli.errors import H2OError
from h2o_cli.prompting import ANSWER_CUE, NewChunk, document_frame, read_then_answer
from h2o_cli.saved import SavedRead, model_identity, open_saved, write_saved
from h2o_cli.saved_checks import check_model

# Archive room a save keeps past its text for the questions asked from it (their frames and answers): the
# archive of a resumed cache is the saved one's size.
QUESTION_ROOM = 4096
TEXT = "text"  # `extra["kind"]` of a save made by `h2o stream`


def text_pieces(tokenizer, pieces: Iterable[list[int]], max_tokens: int | None):
    """The ids to read for a save: the document frame's head and the text (cut to `max_tokens`), as
    `prompting.read_then_answer` gives them before a question."""
    for piece in read_then_answer(tokenizer, pieces, "", max_tokens):
        if not isinstance(piece, NewChunk):
            yield piece


def question_pieces(tokenizer, question: str) -> list[list[int]]:
    """What a cache that read a text for a save reads to answer `question`: the question framed as
    `h2o stream --prompt` frames it, as a chunk of its own (a `NewChunk`)."""
    after = document_frame(tokenizer, question, ANSWER_CUE)[1]
    return [NewChunk(tokenizer(after, add_special_tokens=False)["input_ids"])]


def text_identity(source: str) -> dict:
    """What a save records of its text: the file's name, size and SHA-256 (stdin: its name only)."""
    if source == "-":
        return {"source": "stdin"}
    path = Path(source)
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return {"source": str(path), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def save_text_read(path, cache, model, model_name: str, text: dict, spans: dict) -> int:
    """Write a text read (`cache` after `text_pieces`) as a save; returns its bytes."""
    extra = {"kind": TEXT, "text": text, "tokens": cache.tokens_seen, **spans}
    return write_saved(path, cache, model_identity(model, model_name), extra)


def open_text_save(path) -> SavedRead:
    """Open a save made by `h2o stream --save` (H2OError in one line for any other)."""
    saved = open_saved(path)
    if saved.extra.get("kind") != TEXT:
        raise H2OError(f"{saved.path} is a saved chat, not a read text; resume it with h2o chat --resume")
    return saved


def resumed_cache(saved: SavedRead, model, model_name: str, settings):
    """A cache built as the saved one was, with `settings` (`saved.resume_settings`), holding the saved
    state; H2OError in one line when `model` is not the saved one."""
    from h2o_cli.cache import H2OCache

    check_model(saved, model_identity(model, model_name))
    extra = saved.extra
    spans = {"span": extra.get("span"), "archive_span": extra.get("archive_span")}
    cache = H2OCache(model, settings, **spans, archive_reach=saved.archive_reach)
    saved.load_into(cache)
    return cache


def archive_bytes(saved_or_cache) -> int:
    """Bytes of a save's (or a cache's `saved_arrays`') recall archive: K/V, summaries, token index."""
    if isinstance(saved_or_cache, SavedRead):
        entries = saved_or_cache.manifest["arrays"]
        return sum(entry["bytes"] for name, entry in entries.items() if ".archive." in name)
    arrays = saved_or_cache.saved_arrays()
    return sum(t.numel() * t.element_size() for name, t in arrays.items() if ".archive." in name)
