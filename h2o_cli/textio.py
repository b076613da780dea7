"""Reading long text in blocks and tokenizing it incrementally, so a stream never holds the whole book.

A block ends at the last safe cut of what has been read, tried in this order:
1. before a single line ending ("\\n" or "\\r\\n") between two non-space characters (a hard-wrapped line);
2. before a single space between two non-space characters (prose, one paragraph per line, JSONL);
3. between a letter or digit and an ASCII/CJK punctuation mark (minified JSON, code, CJK text);
4. none of these within `2 * block_bytes` characters (e.g. a base64 blob): a cut at `block_bytes` characters.
Cuts 1-3 are pre-token boundaries of byte-level BPE pre-tokenizers (GPT-2, Llama 3, Qwen, SmolLM2): no
pre-token contains a non-space followed by a space or line ending, and letter/digit runs end at punctuation.
So the ids equal `tokenizer(text)` of the whole text (tests check LF/CRLF books, one-paragraph-per-line,
no-newline and minified text on SmolLM2's tokenizer). Cut 4 may split a pre-token: the ids can then differ
from whole-text tokenization around that cut, but memory stays bounded. (Exceptions to the equality: a
tokenizer that adds a prefix space to every call, as SentencePiece's Metaspace does, and special-token text
such as "<|im_end|>" written into the input and cut by rule 3.)

Memory: pending text stays under `3 * block_bytes` characters (two blocks plus one read), whatever the line lengths,
and each character is searched a bounded number of times (no rescans of a growing buffer).
Cutting after a line ending would not be safe: at the end of a block "\\r\\n" or "\\n\\n" pre-tokenize as one
piece, before a word as two.
"""

from __future__ import annotations

import codecs
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from h2o_cli.errors import InputError

BLOCK_BYTES = 1 << 16  # 64 KiB: tokenizing 1 MiB at once costs ~140 MB and a 3 s stall
_PUNCTUATION = r"!-/:-@\[-\^`{-~\u3001-\u3003\u3008-\u3011\uff01-\uff0f\uff1a-\uff20"  # ASCII but "_", CJK
SAFE_CUTS = (
    re.compile(r"(?<=\S)(?=\r?\n\S)"),  # before a hard line break
    re.compile(r"(?<=\S)(?= \S)"),  # before a single space
    re.compile(rf"(?<=[^\W_])(?=[{_PUNCTUATION}])"),  # between a letter/digit and punctuation
)
_LOOK_BACK = 4096  # characters searched first for a cut, from the end of the pending text


def open_source(source: str):
    """A binary file object for a path or `-` (stdin); one-line errors for the usual mistakes."""
    if source == "-":
        return sys.stdin.buffer
    path = Path(source)
    if path.is_dir():
        raise InputError(f"{source} is a directory; give a text file, or - to read stdin")
    if not path.exists():
        raise InputError(f"{source} does not exist; check the path, or use - to read stdin")
    try:
        return path.open("rb")
    except OSError as error:
        raise InputError(f"cannot read {source}: {error.strerror}") from error


def _last_match(pattern: re.Pattern, text: str, start: int) -> int | None:
    cut = None
    for match in pattern.finditer(text, start):
        cut = match.end()
    return cut or None


def safe_cut(text: str, limit: int) -> int | None:
    """Where to end a block of `text`: the last safe cut (module doc, rules 1-3) that leaves at most `limit`
    characters behind, else `limit` characters from the start once `text` is twice that long, else None."""
    floor = max(0, len(text) - limit)  # a cut before this would leave more than `limit` behind
    for pattern in SAFE_CUTS:
        # The tail first: a cut is nearly always there, and searching it is cheap.
        for start in (max(floor, len(text) - _LOOK_BACK), floor):
            cut = _last_match(pattern, text, start)
            if cut is not None:
                return cut
    return limit if len(text) >= 2 * limit else None


def text_blocks(stream, block_bytes: int = BLOCK_BYTES, name: str = "input") -> Iterator[str]:
    """Decode UTF-8 text from a binary stream in blocks cut at safe points (see module doc).

    Reads `block_bytes` at a time; every block, and the text held back, is under `3 * block_bytes` characters.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    pending = ""
    offset = 0
    while True:
        raw = stream.read(block_bytes)
        carried = decoder.getstate()[0]  # bytes of a character split across reads
        try:
            pending += decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as error:
            # Hand over the text before the bad byte, so a partial stream still counts what it read.
            valid = pending + (carried + raw)[: error.start].decode("utf-8")
            if valid:
                yield valid
            raise InputError(
                f"{name} is not UTF-8 text (bad byte at offset {offset - len(carried) + error.start}); "
                "convert it first, e.g. `iconv -f latin1 -t utf-8`"
            ) from None
        offset += len(raw)
        if not raw:
            if pending:
                yield pending
            return
        cut = safe_cut(pending, block_bytes)  # one block per read, more only to stay under the bound
        while cut is not None:
            yield pending[:cut]
            pending = pending[cut:]
            cut = safe_cut(pending, block_bytes) if len(pending) >= 2 * block_bytes else None


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """Ids the tokenizer adds before and after a text by default."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    start = full.index(plain[0]) if plain and plain[0] in full else 0
    return full[:start], full[start + len(plain) :]


def token_stream(tokenizer, blocks: Iterator[str]) -> Iterator[list[int]]:
    """Token ids of the concatenated blocks, as `tokenizer(text)` would give them (default special tokens)."""
    prefix, suffix = special_tokens(tokenizer)
    if prefix:
        yield list(prefix)
    for block in blocks:
        ids = tokenizer(block, add_special_tokens=False)["input_ids"]
        if ids:
            yield ids
    if suffix:
        yield list(suffix)
