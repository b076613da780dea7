"""Turn framing: the template text to feed for one new turn, given what the cache already holds."""

from __future__ import annotations

from h2o_cli.prompting import user_frame

_MARK = "\u2063H2O-ANSWER\u2063"


def rendered(tokenizer, system: str | None, history: list[dict]) -> str:
    """The template text of a finished conversation (no generation prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        text = "" if system is None else system + "\n\n"
        for message in history:
            text += (
                message["content"]
                if message["role"] == "user"
                else "\n\nAnswer:" + message["content"] + "\n\n"
            )
        return text
    messages = ([{"role": "system", "content": system}] if system else []) + list(history)
    return tokenizer.apply_chat_template(messages, tokenize=False)


def turn_text(tokenizer, system: str | None, history: list[dict], user_text: str) -> str:
    """Text to feed for a new user message: whatever the template adds after `history`, the message, and
    the assistant header. Only the new part: the cache already holds the earlier turns."""
    before, after = user_frame(tokenizer, system, history)
    if not history:
        return before + user_text + after
    previous = rendered(tokenizer, system, history)
    if before.startswith(previous):
        return before[len(previous) :] + user_text + after
    # A template that rewrites earlier turns: fall back to the separator it puts between two turns.
    dummy = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
    dummy_before, _ = user_frame(tokenizer, system, dummy)
    dummy_previous = rendered(tokenizer, system, dummy)
    head = dummy_before[len(dummy_previous) :] if dummy_before.startswith(dummy_previous) else ""
    return head + user_text + after


def turn_parts(tokenizer, system: str | None, history: list[dict], user_text: str) -> tuple[str, str]:
    """`turn_text` in two: (text, question). The question is the message's last paragraph (after its last
    blank line; the whole message when it has none) with the assistant header: what a `recall` cache chooses
    with, as `h2o stream --prompt` asks after a document. `text` is the rest ("" for a one-paragraph message)."""
    whole = turn_text(tokenizer, system, history, user_text)
    body = user_text.rstrip()
    cut = body.rfind("\n\n")
    if cut < 0:
        return "", whole
    start = whole.rfind(user_text)  # the message sits between the template's head and its tail
    split = start + cut + 2 if start >= 0 else 0
    return whole[:split], whole[split:]


def answer_suffix(tokenizer, system: str | None) -> str:
    """Text the template puts after an assistant answer (`<|im_end|>\\n` for ChatML); fed to close a turn."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n\n"
    messages = [{"role": "user", "content": "A"}, {"role": "assistant", "content": _MARK}]
    text = rendered(tokenizer, system, messages)
    return text.split(_MARK, 1)[1] if _MARK in text else ""


def frame_flags(tokenizer, text: str, content: tuple[int, int] | None) -> tuple[list[int], list[bool]]:
    """(ids, is_frame) of `text` tokenized as the chat feeds it (no special tokens added): a token is the
    template's (a role marker, a turn end, the system message, a separator) when its characters lie outside
    `content`, the `[start, end)` span of the user's message in `text` (None: the whole text is template).
    A tokenizer without offsets (a slow one) marks its special tokens only."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
    except (NotImplementedError, KeyError, TypeError, ValueError):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        special = set(getattr(tokenizer, "all_special_ids", []))
        return ids, [content is None or token in special for token in ids]
    if content is None:
        return encoded["input_ids"], [True] * len(offsets)
    start, end = content
    return encoded["input_ids"], [stop <= start or begin >= end for begin, stop in offsets]


def stop_ids(tokenizer, suffix: str) -> set[int]:
    """Ids that end an answer: eos, and the first token of the end-of-turn text when it is a special token."""
    stops = set()
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    suffix_ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix.strip() else []
    if suffix_ids and suffix_ids[0] in set(getattr(tokenizer, "all_special_ids", [])):
        stops.add(int(suffix_ids[0]))
    return stops
