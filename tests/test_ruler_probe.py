"""research/ruler_probe.py's pieces that decide what a row of docs/results.md says: which line holds a RULER
target, and the page orders its variants give the lead (no model: hand-made page scores, ranked as the lead
ranks them, by `order_key` and one sort)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from h2o_cli.cache.recall.archive import NOTHING

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # `research` is a folder of the repository, not of the package
    import research.ruler_probe as probe

    return probe


def ranked(key_fn, score: list[float], size: int = 4) -> list[int]:
    """Pages best first, as `LeadRanking.ranked` sorts the keys (pages without a candidate left out)."""
    score = torch.tensor(score)
    page_start = torch.arange(len(score)) * size
    key = key_fn(score, page_start, (page_start != NOTHING) & (score > 0))
    values, pages = torch.sort(key, descending=True)
    return pages[values > torch.iinfo(torch.int64).min].tolist()


def test_targets_are_read_from_the_logged_string_list(probe):
    assert probe.targets_of({"target": "['8486647']"}) == ["8486647"]
    assert probe.targets_of({"target": "['1', '22']"}) == ["1", "22"]
    assert probe.targets_of({"target": "5"}) == ["5"]


def test_the_sentence_holding_a_value_is_found_whole(probe):
    text = "intro\nkey a is: 111.\nkey b is: 222.\nkey c is: 111."
    spans = probe.line_spans(text, "111")
    assert [text[start:end] for start, end in spans] == ["key a is: 111.", "key c is: 111."]
    assert probe.line_spans(text, "333") == []
    essay = "Essays go on. And on. One of the special magic numbers for x-y is: 123. More text. Yes"
    assert [essay[a:b] for a, b in probe.line_spans(essay, "123")] == [
        "One of the special magic numbers for x-y is: 123."
    ]


def test_the_plain_variants_are_the_lead_ranking(probe):
    # pN and nextN rank as the cache does (nextN's pages after a hit: `LeadRanking.key`, --lead-next)
    assert ranked(probe.widened("p8"), [0.1, 0.5, 0.2, 0.0]) == [1, 2, 0]
    assert ranked(probe.widened("next8"), [0.1, 0.5, 0.2, 0.0]) == [1, 2, 0]


def test_before_brings_the_page_before_each_hit_just_below_it(probe):
    # page 2 is best; page 1 (before it) comes right after it, above page 3's own 0.4
    assert ranked(probe.widened("before16"), [0.1, 0.05, 0.9, 0.4]) == [2, 1, 3, 0]


def test_around_brings_both_neighbours(probe):
    order = ranked(probe.widened("around24"), [0.0, 0.05, 0.9, 0.01, 0.3])
    assert order[0] == 2 and set(order[1:3]) == {1, 3}


def test_the_oracle_ranks_the_needle_pages_first_then_the_lead_order(probe):
    # pages of 4 tokens; the asked line spans tokens 9..13: pages 2 and 3 (starts 8 and 12), even unscored
    order = ranked(probe.widened("oracle8", needle=(9, 14), size=4), [0.5, 0.9, 0.0, 0.1, 0.3])
    assert order == [3, 2, 1, 0, 4]


def test_sample_ids_read_ranges_and_single_ids(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from research.ruler_samples import doc_ids

    assert doc_ids("0-2,5") == [0, 1, 2, 5]
    assert doc_ids("5,1-2,2") == [1, 2, 5]  # in lm-eval's reading order, each once
    assert doc_ids("7") == [7]


def test_intro_ranks_the_opening_pages_first_then_the_lead_order(probe):
    # pages of 4 tokens: intro2 forces pages 0 and 1 (tokens 0..7) in, even unscored, above the best page 2
    assert ranked(probe.widened("intro2", size=4), [0.5, 0.0, 0.9, 0.1]) == [0, 1, 2, 3]


def test_the_modifiers_change_the_answer_and_are_undone(probe, monkeypatch):
    """`introN` takes N pages on top of the defaults' count; `+hold` makes the lead layer's answer steps carry
    no scores; `+contiguous` places R before the recent window; `restored` puts all three back."""
    from types import SimpleNamespace

    from h2o_cli.cache.recall import lead as lead_module
    from h2o_cli.cache.recall.layer import RecallLayer

    monkeypatch.setattr(lead_module, "order_key", lead_module.order_key)  # `under` swaps it
    archive = SimpleNamespace(page_size=16)
    lead = lead_module.LeadRanking(archive, head=0, pages=8, follow=1)
    layer = RecallLayer.__new__(RecallLayer)  # the attributes `_lead_scores` and the placement read
    layer.__dict__.update(lead=lead, archive=archive, policy=SimpleNamespace(recall_place="index"))
    cache = SimpleNamespace(lead=lead, layers=[layer], restore=lambda state: None)
    places = {id(layer.policy): (layer.policy, "index")}

    probe.under(cache, None, "intro2+hold+contiguous", (0, 0))
    assert (lead.count, lead.outliers, lead.follow) == (8 * 2 + 2, 100.0, 1)
    assert layer.policy.recall_place == "contiguous"
    lead.ready = False
    layer._lead_scores(None, None)  # held: nothing carried (a query of None would fail), the ranking ready
    assert lead.ready

    probe.restored(cache, places)
    assert type(lead) is lead_module.LeadRanking and lead.count == 16
    assert "_lead_scores" not in layer.__dict__ and layer.policy.recall_place == "index"
