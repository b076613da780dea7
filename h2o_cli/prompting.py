"""Prompt framing shared by `stream`, `chat` and `eval`: chat-template text around a user message, and
read-then-answer — a document, then a question about it, as one user message."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

_MARK = "\u2063H2O-CONTENT\u2063"
ANSWER_CUE = "\n\nAnswer:"  # what a base model (no chat template) is given to start its answer


def user_frame(tokenizer, system: str | None = None, history: list[dict] | None = None) -> tuple[str, str]:
    """(before, after): template text around one user message, ending where the assistant's answer starts.

    With no chat template the frame is plain text ("", "\\n\\nAnswer:").
    """
    if not getattr(tokenizer, "chat_template", None):
        return ("" if system is None else system + "\n\n"), ANSWER_CUE
    messages = ([{"role": "system", "content": system}] if system else []) + list(history or [])
    messages.append({"role": "user", "content": _MARK})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    before, after = text.split(_MARK)
    return before, after


def document_frame(tokenizer, question: str, answer_cue: str = "") -> tuple[str, str]:
    """(before, after): text around a document so the model reads it, then `question`, then answers.

    With a chat template, document + "\\n\\n" + question form one user message (as lost-in-the-middle did for
    its chat models) and `after` ends at the assistant header; without one, plain text: the document, a blank
    line, the question, then `answer_cue` (e.g. `ANSWER_CUE`; "" when the question ends in its own cue).
    """
    if getattr(tokenizer, "chat_template", None):
        before, after = user_frame(tokenizer)
        return before, "\n\n" + question + after
    return "", "\n\n" + question + answer_cue


class NewChunk(list):
    """Token ids that end the chunk they are read in (`h2o_cli.streaming.chunks_of`): the question after a
    text, read with the text's last tokens when it fits, its queries alone choosing what `recall` brings back."""


def read_then_answer(
    tokenizer, pieces: Iterable[list[int]], question: str, max_text_tokens: int | None = None
) -> Iterator[list[int]]:
    """Token ids to feed for "read this document, then answer": the frame's head, the document's ids
    (`pieces`, cut to their first `max_text_tokens`), then the question and the assistant header.

    The limit applies to the document only: the question is always asked in full, and ends its chunk
    (`NewChunk`).
    """
    before, after = document_frame(tokenizer, question, ANSWER_CUE)
    head = tokenizer(before, add_special_tokens=False)["input_ids"]
    if head:
        yield head
    taken = 0
    for piece in pieces:
        if max_text_tokens is not None:
            piece = piece[: max_text_tokens - taken]
        if piece:
            yield piece
        taken += len(piece)
        if max_text_tokens is not None and taken >= max_text_tokens:
            break
    yield NewChunk(tokenizer(after, add_special_tokens=False)["input_ids"])
