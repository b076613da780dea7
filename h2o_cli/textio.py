"""Reading long text in blocks and tokenizing it incrementally, so a stream never holds the whole book.

Blocks are cut just before a single line ending ("\n" or "\r\n") that sits between two non-space
characters (a hard-wrapped line end). Byte-level BPE pre-tokenizers (GPT-2, Llama 3, SmolLM2) split there
anyway, so the ids equal `tokenizer(text)` of the whole text (tests check this on LF and CRLF books).
Cutting after the line ending would not be safe: at the end of a block "\r\n" or "\n\n" pre-tokenize
as one piece, before a word as two.
"""

from __future__ import annotations

import codecs
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from h2o_cli.errors import InputError

BLOCK_BYTES = 1 << 16  # 64 KiB: tokenizing 1 MiB at once costs ~140 MB and a 3 s stall
_CUT = re.compile(r"(?<=\S)(?=\r?\n\S)")


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


def text_blocks(stream, block_bytes: int = BLOCK_BYTES, name: str = "input") -> Iterator[str]:
    """Decode UTF-8 text from a binary stream in blocks cut at safe points (see module doc)."""
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
        cut = None
        for match in _CUT.finditer(pending):
            cut = match.end()
        if cut is not None:
            yield pending[:cut]
            pending = pending[cut:]


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
