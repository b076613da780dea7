"""The shortlist's two levels (sections, then blocks): the pages `PageArchive.shortlisted` picks, against the
rule computed from the written keys in float64 (docs/spec.md, recall: choice)."""

from __future__ import annotations

import pytest
import torch

from h2o_cli.cache.recall import scores
from h2o_cli.cache.recall.archive import PageArchive, PageSettings

SECTIONED = PageSettings(8, block_size=4, attention=True, shortlist=8)  # pages of 8, blocks of 4, 8 scored


def rule(
    keys: torch.Tensor, query: torch.Tensor, page: int, block: int, section: int, shortlist: int
) -> list[set]:
    """Per KV head: the `shortlist` pages with the best block bound among the pages of the best
    ceil(2 * shortlist / section) sections by their own bound (min/max over all their keys); ties: older.
    keys [n_kv, T, d] as written (no wrap); query [n_kv, m, d]."""
    tokens = keys.shape[1]
    pages = -(-tokens // page)

    def bound(head: int, start: int, end: int) -> float:
        k = keys[head, start : min(end, tokens)].double()
        low, high = k.min(dim=0).values, k.max(dim=0).values
        return max(float(torch.maximum(q * high, q * low).sum()) for q in query[head].double())

    def page_bound(head: int, p: int) -> float:
        return max(bound(head, b, b + block) for b in range(p * page, (p + 1) * page, block) if b < tokens)

    picked, width = [], section * page
    for head in range(keys.shape[0]):
        order = sorted(
            range(-(-pages // section)), key=lambda s: (-bound(head, s * width, (s + 1) * width), s)
        )  # noqa: B023
        kept = [
            p for s in order[: -(-2 * shortlist // section)] for p in range(s * section, (s + 1) * section)
        ]
        ranked = sorted((p for p in kept if p < pages), key=lambda p: (-page_bound(head, p), p))  # noqa: B023
        picked.append(set(ranked[:shortlist]))
    return picked


def picks(archive: PageArchive, query: torch.Tensor, fixed: bool = False) -> list[set]:
    pages = -(-archive.tokens // archive.page_size)
    starts = archive.token_index.view(archive.pages, archive.page_size)[:pages, 0]
    return [set(row.tolist()) for row in archive.shortlisted(query, pages, starts, fixed)]


@pytest.mark.parametrize(("tokens", "capacity"), [(700, 4096), (768, 4096), (760, 4040)])
def test_sections_then_blocks_pick_the_pages_the_rule_picks(monkeypatch, tokens, capacity):
    """Sections of 32 tokens (4 pages of 8, blocks of 4), a shortlist of 8: 2 * 8 / 4 = 4 sections kept of 22-24
    (a quarter or less: two levels). Written in a piece, then token by token with picks in between, so the
    section summaries are refreshed where the writes went; the fixed-shape fold picks the same. A ring of
    4,040 tokens (505 pages) ends in a section of one page."""
    monkeypatch.setattr(scores, "SECTION_TOKENS", 32)
    torch.manual_seed(0)
    archive = PageArchive(2, 8, capacity, SECTIONED, torch.float32, torch.device("cpu"))
    assert archive.section_pages == 4 and archive.section_summary.shape[1] == -(-capacity // 32)
    keys, query = torch.randn(2, tokens, 8), torch.randn(2, 3, 8)

    def expected(written: int) -> list[set]:  # two levels from 16 sections (4 kept) on, else the flat rule
        two_levels = -(-written // 32) >= 16
        return rule(keys[:, :written], query, 8, 4, 4 if two_levels else 10**6, 8)

    archive.write(keys[:, : tokens // 2], keys[:, : tokens // 2])
    assert picks(archive, query) == expected(tokens // 2)
    for t in range(tokens // 2, tokens):
        archive.write(keys[:, t : t + 1], keys[:, t : t + 1])
        if t % 150 == 0:
            assert picks(archive, query) == expected(t + 1)
    assert picks(archive, query) == expected(tokens) and picks(archive, query, fixed=True) == expected(tokens)
    # A rewind forgets the newest tokens; the sections are folded again from what is left.
    archive.rewind(tokens - 100)
    assert picks(archive, query) == expected(tokens - 100)


def test_few_sections_use_the_flat_bound(monkeypatch):
    """When the kept sections would hold more than a quarter of the pages, every block is bounded (the flat
    shortlist): the pages of the rule with one section holding them all."""
    monkeypatch.setattr(scores, "SECTION_TOKENS", 32)
    torch.manual_seed(1)
    archive = PageArchive(2, 8, 1024, SECTIONED, torch.float32, torch.device("cpu"))
    keys, query = torch.randn(2, 400, 8), torch.randn(2, 3, 8)  # 50 pages: 13 sections < 4 * 4 kept
    archive.write(keys, keys)
    assert picks(archive, query) == rule(keys, query, 8, 4, 10**6, 8)
