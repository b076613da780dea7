"""How a stream is cut into chunks (h2o_cli.streaming.chunks_of): fixed sizes, a limit, and a question that
ends the chunk it lands in."""

from __future__ import annotations

from h2o_cli.prompting import NewChunk
from h2o_cli.streaming import AskingChunk, chunks_of


def test_pieces_are_regrouped_into_chunks_of_the_size():
    assert list(chunks_of([[1, 2, 3], [4, 5, 6, 7, 8]], 3)) == [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert list(chunks_of([[1, 2, 3], [4, 5, 6, 7, 8]], 3, limit=5)) == [[1, 2, 3], [4, 5]]


def test_a_question_ends_the_chunk_it_lands_in():
    """A `NewChunk` piece joins the text before it when it fits in that chunk's room (an `AskingChunk` telling
    how many of its ids are the question), else starts a chunk of its own; nothing follows it in a chunk."""
    text, question = [[1, 2, 3], [4, 5, 6, 7, 8]], NewChunk([9, 10, 11])
    chunks = list(chunks_of([*text, question], 4))
    assert chunks == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]  # no room after 8: a chunk of its own
    assert isinstance(chunks[-1], AskingChunk) and chunks[-1].asks == 3
    chunks = list(chunks_of([*text, question], 6))
    assert chunks == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]] and chunks[-1].asks == 3  # joins 7, 8
    chunks = list(chunks_of([*text, question, [12, 13]], 6))
    assert chunks == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13]]  # the question ends its chunk
    assert chunks[1].asks == 3 and not isinstance(chunks[2], AskingChunk)
    assert list(chunks_of([question], 2)) == [[9, 10], [11]]  # longer than a chunk: plain chunks
    assert not any(isinstance(chunk, AskingChunk) for chunk in chunks_of([question], 2))
    ids = [t for chunk in chunks_of([*text, question], 3) for t in chunk]
    assert ids == list(range(1, 12))  # the same ids in the same order


def test_stream_sizes_the_cache_for_what_it_can_read():
    """`h2o stream` tells the cache the most tokens it can meet, so a recall archive is no larger than the text:
    the file's bytes or --max-tokens (the smaller), plus the question, its frame and the answer; stdin without
    --max-tokens is unknown."""
    from h2o_cli.cli.stream import _span
    from h2o_cli.generation import Sampling

    sampling = Sampling(max_new_tokens=12)
    assert _span(None, None, None, sampling) is None
    assert _span(None, 5000, None, sampling) == 5000
    assert _span(3000, 5000, None, sampling) == 3000
    assert _span(3000, None, "Who?", sampling) == 3000 + 4 + 256 + 12


def test_a_recall_stream_counts_a_files_tokens_to_size_its_archive(tmp_path):
    """`_text_tokens`: the ids the stream will read (`tokenizer(text)` of the whole file, special tokens too),
    the file left at its start; a file that is not UTF-8 counts as its bytes, so the stream still reads its
    valid part and says why it stopped."""
    from conftest import word_tokenizer

    from h2o_cli.cli.stream import _text_tokens

    tokenizer = word_tokenizer(16)
    text = " ".join(f"w{number % 16}" for number in range(30000))
    path = tmp_path / "text.txt"
    path.write_text(text)
    with open(path, "rb") as source:
        source.read(7)
        assert _text_tokens(source, tokenizer) == len(tokenizer(text)["input_ids"])
        assert source.tell() == 0
    path.write_bytes(b"w3 w4 \xff w5")
    with open(path, "rb") as source:
        assert _text_tokens(source, tokenizer) == 10 and source.tell() == 0  # its bytes
