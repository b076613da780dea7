"""research/recall_oracle.py's `Oracle`: what it forces into the recall slots, and what it keeps of the choice.

The oracle is what every "is it the choice or the placement?" row of docs/results.md rests on, so its slot
arithmetic is checked here on hand-made slots (no model): the needle's archived tokens not in S first, then
the choice's own valid slots in its order (`oracleN`: only N of them), or, without forcing, the choice cut to
its first N slots or to pages holding a share of the head's carried score.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from h2o_cli.cache.recall import layer as recall_layer
from h2o_cli.cache.recall.archive import PageArchive

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def oracle_class(monkeypatch):
    """`Oracle`, with everything it patches put back after the test."""
    monkeypatch.syspath_prepend(str(REPO))  # `research` is a folder of the repository, not of the package
    for name in ("choose", "choose_one"):
        monkeypatch.setattr(PageArchive, name, getattr(PageArchive, name))
    monkeypatch.setattr(recall_layer, "recall_is_full", recall_layer.recall_is_full)
    from research.recall_oracle import Oracle

    return Oracle


def archive_of(tokens: int, page_size: int = 4, carried=None):
    """What `Oracle` reads of a `PageArchive`: token `t` in ring slot `t`."""
    return SimpleNamespace(
        token_index=torch.arange(tokens), capacity=tokens, page_size=page_size, carried=carried
    )


def choice():
    """One KV head's choice: slots 40-43 and 10 and 5 valid, two empty columns (numbers left in them)."""
    chosen = torch.tensor([[40, 41, 42, 43, 10, 5, 7, 9]])
    valid = torch.tensor([[True, True, True, True, True, True, False, False]])
    return chosen, valid


@pytest.mark.parametrize(
    ("rest", "expected"),
    [
        (None, [10, 12, 40, 41, 42, 43, 5]),  # the needle (11 is in S), then the choice's valid slots
        (2, [10, 12, 40, 41]),
        (0, [10, 12]),
    ],
)
def test_forced_needle_then_the_choice(oracle_class, rest, expected):
    oracle = oracle_class(True, group=3, rest=rest)
    oracle.start([10, 11, 12], [11], question=60)
    chosen, valid = choice()
    got, got_valid = oracle.visit(archive_of(64), chosen, valid, resident=torch.tensor([[11, 50]]))
    assert got[0, : len(expected)].tolist() == expected
    assert got_valid[0].tolist() == [True] * len(expected) + [False] * (8 - len(expected))
    assert recall_layer.recall_is_full(10**6, 1, 8) is False  # a partial R stays partial at answer steps


def test_first_slots_of_the_choice(oracle_class):
    oracle = oracle_class(False, group=3, rest=3)
    oracle.start([10, 11, 12], [11], question=60)
    chosen, valid = choice()
    got, got_valid = oracle.visit(archive_of(64), chosen, valid, resident=torch.tensor([[50]]))
    assert torch.equal(got, chosen)
    assert got_valid[0].tolist() == [True, True, True] + [False] * 5


def test_pages_by_share_of_the_carried_score(oracle_class):
    carried = torch.zeros(1, 16)
    carried[0, 10] = 0.7  # page 10: slots 40-43
    carried[0, 2] = 0.25  # page 2: slots 8-11
    carried[0, 1] = 0.05  # page 1: slots 4-7
    oracle = oracle_class(False, group=3, share=0.1)
    oracle.start([10, 11, 12], [11], question=60)
    oracle.phase = "question"
    chosen, valid = choice()
    _, got_valid = oracle.visit(archive_of(64, carried=carried), chosen, valid, torch.tensor([[50]]))
    assert got_valid[0].tolist() == [True, True, True, True, True, False, False, False]
    heads, recalled = oracle.question_detail(1)
    assert heads == [] and recalled == 5.0  # no passkey digit (token 11) among S and the 5 recalled


def test_model_vote_puts_the_same_pages_first_in_every_head(oracle_class):
    """Two layers vote: each head gives each page its share of the head's carried score; the pages with the
    most votes summed over both layers' heads lead every head's R, then the head's own choice."""
    first, second = torch.zeros(2, 16), torch.zeros(2, 16)
    first[0, 3], first[1, 5] = 1.0, 1.0  # layer A's two heads: page 3, page 5
    second[0, 3], second[0, 7], second[1, 3] = 1.0, 3.0, 1.0  # layer B: page 7 (3/4), 3 (1/4); page 3
    oracle = oracle_class(False, group=3, rest=2, vote_pages=1)
    oracle.start([10, 11, 12], [11], question=60)
    chosen, valid = torch.tensor([[40, 41, 42, 43, 0, 0]] * 2), torch.tensor([[True] * 4 + [False] * 2] * 2)
    layer_a, layer_b = archive_of(64, carried=first), archive_of(64, carried=second)
    oracle.visit(layer_a, chosen, valid, torch.tensor([[50], [50]]))
    got, got_valid = oracle.visit(layer_b, chosen, valid, torch.tensor([[13], [50]]))
    # Page 3 (slots 12-15): 1 + 1/4 + 1 = 2.25 votes, page 7: 3/4, page 5: 1. Head 0 holds token 13 in S.
    assert got[0, :5].tolist() == [12, 14, 15, 40, 41]
    assert got[1, :6].tolist() == [12, 13, 14, 15, 40, 41]
    assert got_valid.sum(dim=1).tolist() == [5, 6]


@pytest.mark.parametrize(
    ("before", "chunk", "question", "phase"),
    [
        (0, 32, False, "text"),  # a chunk of text before the question
        (40, 32, False, "question"),  # a chunk of 32 reaching token 60, two of its tokens choosing
        (40, 4, True, "question"),  # the question asked at the end of a longer chunk
    ],
)
def test_question_chunk_found_by_its_tokens_not_its_choosing_ones(
    oracle_class, monkeypatch, before, chunk, question, phase
):
    """The oracle forces the needle from the chunk that holds the question on, however few of that chunk's
    tokens choose (`--choice-tokens`) and wherever the question starts inside it."""
    monkeypatch.setattr(PageArchive, "choose", lambda *args, **kwargs: choice())
    oracle = oracle_class(True, group=3)
    oracle.start([10, 11, 12], [11], question=60)
    query = torch.zeros(1, 3 * 2, 8)  # two of the chunk's tokens choose
    PageArchive.choose(archive_of(64), query, torch.tensor([[50]]), before, 8, chunk, question=question)
    assert oracle.phase == phase


def test_key_page_rank_counts_the_pages_scored_above_it(oracle_class):
    """Head 0 scores two pages above the key's (page 2, tokens 8-11), head 1 none; the question's row has them."""
    carried = torch.zeros(2, 16)
    carried[0, [2, 5, 7, 9]] = torch.tensor([0.3, 0.5, 0.4, 0.1])
    carried[1, [2, 5]] = torch.tensor([0.6, 0.2])
    oracle = oracle_class(False, group=3)
    oracle.start([10, 11, 12], [11], question=60)
    oracle.phase = "question"
    chosen, valid = choice()
    oracle.visit(
        archive_of(64, carried=carried), chosen.expand(2, -1), valid.expand(2, -1), torch.tensor([[50], [50]])
    )
    assert oracle.question_key_ranks(1) == {"0.0": 2, "0.1": 0}
