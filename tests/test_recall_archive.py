"""The recall archive (h2o_cli/cache/recall/: store, scores, archive): what its writes keep, how its page bounds
and page order choose, and how it drops its oldest pages."""

from __future__ import annotations

import pytest
import torch

from h2o_cli.cache import H2OCache
from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.config import CacheSettings

N_KV, HEAD_DIM = 2, 16


def rank_key(bound: torch.Tensor, page_start: torch.Tensor, tokens: int) -> torch.Tensor:
    """The page order written another way, the reference `order_key` is held to: one float64 key per (KV head,
    page) whose descending order is "larger bound first, then the older page": the float32 bound plus a tie-break under a quarter of its float32 spacing (ulp), larger for older
    pages. Distinct float32 bounds stay in their order (the tie-break never reaches half an ulp) and equal ones
    are ordered by age, so one `topk` replaces a sort by age and a stable sort by bound.

    bound: [n_kv_heads, pages] float32 (-inf for pages that cannot be chosen); page_start: [pages] token index
    of each page's first token (smaller = older; -1 = empty), every one below `tokens` (a Python int, so the
    key needs no read back from the device)."""
    ulp = (torch.nextafter(bound, torch.full_like(bound, float("inf"))) - bound).double()
    youth = (page_start + 1).double() / (tokens + 1)  # [0, 1): smaller for older pages
    return bound.double() + torch.nan_to_num(ulp * 0.25 * (1.0 - youth), nan=0.0, posinf=0.0)


def exact_bounds(keys: torch.Tensor, token_index: torch.Tensor, queries: torch.Tensor, size: int):
    """Per (head, page): Quest's bound from the raw keys, and the best key's exact logit, maxed over queries.

    keys: [n_kv, capacity, d] in slot order, token_index [capacity]; queries [n_kv, m, d]. Written with loops.
    """
    pages = keys.shape[1] // size
    bound = torch.full((keys.shape[0], pages), float("-inf"), dtype=torch.float64)
    best = bound.clone()
    for head in range(keys.shape[0]):
        for page in range(pages):
            slots = [s for s in range(page * size, (page + 1) * size) if token_index[s] >= 0]
            if not slots:
                continue
            page_keys = keys[head, slots].double()
            low, high = page_keys.min(0).values, page_keys.max(0).values
            for q in queries[head].double():
                bound[head, page] = max(bound[head, page], float(torch.maximum(q * low, q * high).sum()))
                best[head, page] = max(best[head, page], float((page_keys @ q).max()))
    return bound, best


@pytest.mark.parametrize("bits", [None, 8])
def test_the_keys_an_answer_keeps_follow_the_writes(bits):
    """`held_page_keys`: the keys of the pages an answer's steps score, kept between steps, are the archive's
    own (rounded to float16, as the steps score them) after every write — tokens written into one of those
    pages, and a page the ring gives to a new one."""
    torch.manual_seed(11)
    pages = PageSettings(4, attention=True, shortlist=3, carry=0.9)
    archive = PageArchive(N_KV, HEAD_DIM, 24, pages, torch.float32, torch.device("cpu"), bits)
    keys = torch.randn(N_KV, 40, HEAD_DIM)
    archive.write(keys[:, :10], keys[:, :10])
    picked = torch.tensor([[0, 1, 2], [1, 2, 4]])  # ring pages of 4 tokens; page 2 is being written
    for token in range(10, 40):  # fills page 2, then the ring (6 pages) wraps over pages 0, 1, 2 and 4
        held = archive.held_page_keys(picked)
        written = archive.token_index[(picked.unsqueeze(-1) * 4 + torch.arange(4)).flatten(1)] >= 0
        assert held.dtype == torch.float16
        assert torch.equal(held[written], archive.page_keys(picked).half()[written]), token
        archive.write(keys[:, token : token + 1], keys[:, token : token + 1])
    assert archive.oldest == 16


def test_page_choice_agrees_with_the_exact_bound_and_finds_a_planted_key():
    torch.manual_seed(5)
    size, capacity = 4, 64
    archive = PageArchive(N_KV, HEAD_DIM, capacity, PageSettings(size), torch.float32, torch.device("cpu"))
    keys = torch.randn(N_KV, 90, HEAD_DIM)
    queries = torch.randn(N_KV, 3, HEAD_DIM)  # e.g. 3 query heads of a group, or a chunk's queries
    needle = (
        45  # a key aligned with the first query: its page must come first where its logit beats every bound
    )
    keys[:, needle] = queries[:, 0] * 3
    archive.write(keys[:, :50], torch.zeros(N_KV, 50, HEAD_DIM))
    archive.write(keys[:, 50:], torch.zeros(N_KV, 40, HEAD_DIM))
    assert archive.oldest == 28 and archive.held() == 62  # 90 tokens, 16 pages of 4: pages 7..22 remain
    resident = torch.tensor([[30, 31, 80, 85, 89, -1], [29, 44, 45, 60, 88, 89]])
    chosen, valid = archive.choose(queries, resident, before=86, slots=10)

    bound, best = exact_bounds(archive.keys, archive.token_index, queries, size)
    for head in range(N_KV):
        slots = chosen[head][valid[head]].tolist()
        tokens = archive.token_index[slots].tolist()
        held = archive.token_index
        candidates = {
            t for t in held.tolist() if 0 <= t < 86 and t not in resident[head].tolist()
        }  # older than the chunk, not resident
        assert set(tokens) <= candidates and len(tokens) == 10
        # The summary never underestimates a page's best logit.
        assert bool((bound[head] >= best[head] - 1e-4).all())
        # The pages of the chosen tokens are the top pages under the independent bound (whole pages first).
        page_of = {t: (t % capacity) // size for t in held.tolist() if t >= 0}
        with_candidates = sorted(
            {page_of[t] for t in candidates}, key=lambda p: (-float(bound[head, p]), int(held[p * size]))
        )
        expected = [t for p in with_candidates for t in sorted(c for c in candidates if page_of[c] == p)][:10]
        assert tokens == expected
        if needle not in resident[head].tolist():  # head 0: the needle's exact logit beats every other bound
            others = [p for p in with_candidates if p != page_of[needle]]
            assert best[head, page_of[needle]] > bound[head, others].max()
            assert needle in tokens
    assert 45 not in archive.token_index[chosen[1][valid[1]]].tolist()  # head 1 holds it: never twice


@pytest.mark.parametrize("form", ["token", "fixed"])
@pytest.mark.parametrize("bits", [None, 8])
def test_one_token_writes_are_the_piece_write(bits, form):
    """The one-token writes — `PageArchive.write` of one token (a decode step's fast form, and archive.c's twin
    of it) and `write_fixed` (the fixed step's, the token's index a tensor) — leave the archive bit for bit as
    writing the same tokens in pieces (`_write_piece`, the rule): through two wraps of the ring, pages starting
    mid-piece, NaN-free keys with exact zeros (min/max ties)."""
    torch.manual_seed(9)
    keys, values = torch.randn(N_KV, 130, HEAD_DIM), torch.randn(N_KV, 130, HEAD_DIM)
    keys[:, ::5] = 0.0
    by_token, by_piece = (
        PageArchive(N_KV, HEAD_DIM, 48, PageSettings(3), torch.float32, torch.device("cpu"), bits)
        for _ in "ab"
    )
    for token in range(130):
        if form == "token":
            by_token.write(keys[:, token : token + 1], values[:, token : token + 1])
        else:
            by_token.write_fixed(
                keys[:, token : token + 1], values[:, token : token + 1], torch.tensor([token])
            )
            by_token.stepped_fixed()
    for start in range(0, 130, 7):
        by_piece.write(keys[:, start : start + 7], values[:, start : start + 7])
    assert by_token.tokens == by_piece.tokens == 130
    assert torch.equal(by_token.token_index, by_piece.token_index)
    assert torch.equal(by_token.summary, by_piece.summary)
    held = by_token.token_index >= 0
    stored = ["keys", "values"] + (["key_scales", "value_scales"] if bits else [])
    for name in stored:
        assert torch.equal(getattr(by_token, name)[:, held], getattr(by_piece, name)[:, held]), name


def test_archive_drops_the_oldest_pages_and_keeps_its_buffers(tiny_pair):
    _, model = tiny_pair
    settings = CacheSettings(budget=16, policy="recall", chunk=6, page_size=8, block_size=8, archive_max=40)
    cache = H2OCache(model, settings)
    layer = cache.layers[0]
    archive = layer.archive
    assert archive.capacity == 40
    buffers = [archive.keys, archive.values, archive.token_index, archive.low, archive.high]
    buffers += [layer.recall_keys, layer.recall_values, layer.recall_index, layer.store.keys]
    pointers = [buffer.data_ptr() for buffer in buffers]
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for start in range(0, 300, 6):
            model(ids[:, start : start + 6], cache=cache)
            assert [buffer.data_ptr() for buffer in buffers] == pointers
            seen = start + 6
            newest_page = (seen - 1) // 8 * 8
            oldest = max(0, newest_page + 8 - 40)
            held = sorted(t for t in archive.token_index.tolist() if t >= 0)
            assert held == list(range(oldest, seen)), f"after {seen} tokens"
            assert archive.oldest == oldest
            # Recalled tokens come from what the archive still holds.
            recalled = layer.recall_index[layer.recall_index >= 0]
            assert bool((recalled >= oldest).all())
    summary = cache.archive_summary()
    assert summary.archive_tokens == 300 - 264 and summary.archive_oldest == 264
    # The summaries of each full ring page are its keys' min and max.
    keys = archive.keys.view(archive.n_kv_heads, archive.pages, 8, -1).float()
    full = (archive.token_index.view(archive.pages, 8) >= 0).all(dim=1)
    torch.testing.assert_close(archive.low[:, full], keys[:, full].amin(dim=2))
    torch.testing.assert_close(archive.high[:, full], keys[:, full].amax(dim=2))


def test_rank_key_orders_by_bound_then_age_without_crossing_adjacent_floats():
    """The one-`topk` page order: larger bound first; equal bounds older page first; adjacent float32 bounds
    keep their order whatever the pages' ages (the tie-break stays under half an ulp)."""
    one = torch.tensor(1.0)
    above = torch.nextafter(one, torch.tensor(2.0))
    bound = torch.stack([one, above, one, torch.tensor(float("-inf")), torch.tensor(0.0), -above])[None]
    page_start = torch.tensor([5, 900, 2, 1, 0, 3])  # page 1 is the youngest, yet its bound is larger
    order = torch.argsort(rank_key(bound, page_start, tokens=901), dim=1, descending=True)[0].tolist()
    assert order == [1, 2, 0, 4, 5, 3]


def test_whole_blocks_written_at_once_summarise_as_token_by_token():
    """Pieces of whole summary blocks (a chunk's: one reduction over a view), then pieces that are not and a
    piece that wraps the ring (block by block): the same summaries as the tokens written one at a time."""
    torch.manual_seed(9)
    keys, values = torch.randn(N_KV, 200, HEAD_DIM), torch.randn(N_KV, 200, HEAD_DIM)
    by_token, by_piece = (
        PageArchive(N_KV, HEAD_DIM, 64, PageSettings(8), torch.float32, torch.device("cpu")) for _ in "ab"
    )
    for token in range(200):
        by_token.write(keys[:, token : token + 1], values[:, token : token + 1])
    start = 0
    for size in (16, 8, 32, 5, 3, 16, 24, 48, 8, 40):  # 48 at 104: wraps the 64-slot ring
        by_piece.write(keys[:, start : start + size], values[:, start : start + size])
        start += size
    assert start == 200 and by_piece.block_size == 4
    assert torch.equal(by_token.token_index, by_piece.token_index)
    assert torch.equal(by_token.summary, by_piece.summary)
