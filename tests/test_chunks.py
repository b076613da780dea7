"""How a stream is cut into chunks (h2o_cli.streaming.chunks_of): fixed sizes, a limit, and a question that
starts a chunk of its own."""

from __future__ import annotations

from h2o_cli.prompting import NewChunk
from h2o_cli.streaming import chunks_of


def test_pieces_are_regrouped_into_chunks_of_the_size():
    assert list(chunks_of([[1, 2, 3], [4, 5, 6, 7, 8]], 3)) == [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert list(chunks_of([[1, 2, 3], [4, 5, 6, 7, 8]], 3, limit=5)) == [[1, 2, 3], [4, 5]]


def test_a_new_chunk_piece_is_never_mixed_with_the_text_before_it():
    text, question = [[1, 2, 3], [4, 5, 6, 7, 8]], NewChunk([9, 10, 11])
    assert list(chunks_of([*text, question], 4)) == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    assert list(chunks_of([*text, question], 3)) == [[1, 2, 3], [4, 5, 6], [7, 8], [9, 10, 11]]
    assert list(chunks_of([question], 2)) == [[9, 10], [11]]  # nothing before it: no empty chunk
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
