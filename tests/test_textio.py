"""Incremental reading and tokenization equal `tokenizer(text)` of the whole text."""

from __future__ import annotations

import io
from itertools import chain

import pytest
from conftest import SHARED_DATA

from h2o_cli.errors import InputError
from h2o_cli.textio import text_blocks, token_stream


def test_blocks_rejoin_to_the_text(excerpt):
    blocks = list(text_blocks(io.BytesIO(excerpt.encode()), block_bytes=257))
    assert len(blocks) > 5
    assert "".join(blocks) == excerpt


def test_multibyte_characters_split_across_reads():
    text = "naïve café — “quotes”\n" * 50
    assert "".join(text_blocks(io.BytesIO(text.encode()), block_bytes=7)) == text


def test_non_utf8_is_a_one_line_error():
    with pytest.raises(InputError, match="not UTF-8 text .*offset 3"):
        list(text_blocks(io.BytesIO(b"abc\xff\xfe tail"), name="book.txt"))


def test_block_tokenization_equals_whole_text(smollm, excerpt):
    _, tokenizer = smollm
    pieces = token_stream(tokenizer, text_blocks(io.BytesIO(excerpt.encode()), block_bytes=300))
    assert list(chain.from_iterable(pieces)) == tokenizer(excerpt)["input_ids"]


def test_crlf_text_is_cut_into_blocks_and_tokenizes_the_same(smollm, excerpt):
    _, tokenizer = smollm
    crlf = excerpt.replace("\n", "\r\n")
    blocks = list(text_blocks(io.BytesIO(crlf.encode()), block_bytes=300))
    assert len(blocks) > 5 and "".join(blocks) == crlf
    assert list(chain.from_iterable(token_stream(tokenizer, iter(blocks)))) == tokenizer(crlf)["input_ids"]


@pytest.mark.data
@pytest.mark.parametrize("book", ["pride_and_prejudice_pg1342.txt", "frankenstein_pg84.txt"])
def test_block_tokenization_equals_whole_book(smollm, book):
    _, tokenizer = smollm
    raw = (SHARED_DATA / "gutenberg_books" / book).read_bytes()
    blocks = list(text_blocks(io.BytesIO(raw), block_bytes=1 << 16))
    assert len(blocks) >= len(raw) >> 17  # really cut into blocks
    pieces = token_stream(tokenizer, iter(blocks))
    assert list(chain.from_iterable(pieces)) == tokenizer(raw.decode("utf-8"))["input_ids"]


def paragraph_per_line(text: str) -> str:
    """Hard-wrapped prose → one paragraph per line (Markdown, JSONL and most ebooks look like this)."""
    import re

    return re.sub(r"(?<!\n)\n(?!\n)", " ", text).replace("\n\n", "\n")


def minified(text: str) -> str:
    """JSON of the text's words with no whitespace at all."""
    import json

    return json.dumps([{"id": n, "w": word} for n, word in enumerate(text.split())], separators=(",", ":"))


@pytest.mark.parametrize(
    "shape",
    [paragraph_per_line, lambda text: text.replace("\n", " "), minified],
    ids=["paragraph-per-line", "no-newline", "minified"],
)
def test_unwrapped_text_is_cut_and_tokenizes_the_same(smollm, excerpt, shape):
    """Regression: without hard line wraps the old reader held the whole text as one block."""
    _, tokenizer = smollm
    text = shape(excerpt)
    blocks = list(text_blocks(io.BytesIO(text.encode()), block_bytes=200))
    assert len(blocks) >= len(text) // 600 and max(map(len, blocks)) < 600
    assert "".join(blocks) == text
    assert list(chain.from_iterable(token_stream(tokenizer, iter(blocks)))) == tokenizer(text)["input_ids"]


class CountingReader:
    """A binary stream that records how many bytes were read before each block was handed out."""

    def __init__(self, data: bytes) -> None:
        self.stream = io.BytesIO(data)
        self.bytes = 0

    def read(self, size: int) -> bytes:
        data = self.stream.read(size)
        self.bytes += len(data)
        return data


SINGLE_LINE_TEXTS = {
    "prose": lambda size: ("It was a dark and stormy night; the rain fell in torrents. " * (size // 59 + 1))[
        :size
    ],
    "minified": lambda size: ('{"key":[1,2,3],"value":"abc"},' * (size // 30 + 1))[:size],
    "no-cut-at-all": lambda size: ("QmFzZTY0IGJsb2Igd2l0aG91dCBwdW5jdHVhdGlvbg" * (size // 42 + 1))[:size],
}


@pytest.mark.parametrize("kind", list(SINGLE_LINE_TEXTS))
def test_single_line_megabytes_are_read_in_bounded_blocks(kind):
    """Whatever the text, every block and the text held back stay under 3 blocks of bytes, and the first
    block comes after the same number of bytes read for a 1 MB and an 8 MB file (work to the first tokens
    does not depend on the file's size)."""
    block_bytes = 1 << 14
    first_block_after = []
    for size in (1 << 20, 8 << 20):
        text = SINGLE_LINE_TEXTS[kind](size)
        reader = CountingReader(text.encode())
        handed_out = 0
        for number, block in enumerate(text_blocks(reader, block_bytes=block_bytes)):
            if number == 0:
                first_block_after.append(reader.bytes)
            handed_out += len(block)
            assert len(block) < 3 * block_bytes
            assert reader.bytes - handed_out < 3 * block_bytes  # what is read but not yet handed out
        assert handed_out == len(text)
    assert first_block_after[0] == first_block_after[1] <= 2 * block_bytes
