"""Chat-template framing: the text a model's template puts around a user message."""

from __future__ import annotations

_MARK = "\u2063H2O-CONTENT\u2063"


def user_frame(tokenizer, system: str | None = None, history: list[dict] | None = None) -> tuple[str, str]:
    """(before, after): template text around one user message, ending where the assistant's answer starts.

    With no chat template the frame is plain text ("", "\\n\\nAnswer:").
    """
    if not getattr(tokenizer, "chat_template", None):
        return ("" if system is None else system + "\n\n"), "\n\nAnswer:"
    messages = ([{"role": "system", "content": system}] if system else []) + list(history or [])
    messages.append({"role": "user", "content": _MARK})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    before, after = text.split(_MARK)
    return before, after
