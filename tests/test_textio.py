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


@pytest.mark.skipif(not (SHARED_DATA / "gutenberg_books").is_dir(), reason="shared data not present")
def test_block_tokenization_equals_whole_book(smollm):
    _, tokenizer = smollm
    raw = (SHARED_DATA / "gutenberg_books" / "pride_and_prejudice_pg1342.txt").read_bytes()
    pieces = token_stream(tokenizer, text_blocks(io.BytesIO(raw), block_bytes=1 << 16))
    assert list(chain.from_iterable(pieces)) == tokenizer(raw.decode("utf-8"))["input_ids"]
