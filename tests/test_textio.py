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
