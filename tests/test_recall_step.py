"""The recall policy's one-token decode step (h2o_cli.cache.recall.step, the torch step with `RecallLayer.step_entries`) against
the chunk path it replaces for decode, the naive simulation (tests/naive.py), and `PageArchive.choose`."""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import feed_against_naive
from test_recall import HEAD_DIM, N_HEADS, N_KV, make_recall_layer, naive_settings
from test_recall_archive import rank_key
from torch.utils._python_dispatch import TorchDispatchMode

from h2o_cli.cache import H2OCache, RecallLayer
from h2o_cli.cache.recall.archive import PageArchive, PageSettings, order_key
from h2o_cli.config import CacheSettings


@pytest.fixture
def step_calls(monkeypatch):
    """Counts the one-token torch steps taken by recall layers (each asks `RecallLayer.step_entries` once)."""
    calls = collections.Counter()
    inner = RecallLayer.step_entries

    def counted(self, *args):
        calls["step"] += 1
        return inner(self, *args)

    monkeypatch.setattr(RecallLayer, "step_entries", counted)
    return calls


def run(model, cache, ids, prefill: int, chunk: int, after_step=None):
    """A chunked prefill of `ids[:prefill]`, then one token per call. Returns the logits [1, n, vocab]."""
    logits = []
    with torch.inference_mode():
        for start in range(0, prefill, chunk):
            logits.append(model(ids[:, start : min(start + chunk, prefill)], cache=cache).logits)
        for step in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, step : step + 1], cache=cache).logits)
            if after_step is not None:
                after_step(cache)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("positions", ["rolling", "original"])
@pytest.mark.parametrize("archive", ["ram", "disk", "int8"])
@pytest.mark.parametrize("prefill", [14, 60], ids=["slots-partly-empty", "slots-full"])
def test_decode_step_equals_the_chunk_path(tiny_pair, tmp_path, step_calls, positions, archive, prefill):
    """After a chunked prefill, decode by the one-token step and by the chunk path (`_step_path` off): the
    same logits to float tolerance, and bit for bit the same recalled tokens, resident sets and statistics.
    The torch step (a RAM archive would take the C step under `auto`: tests/test_native_recall.py holds that
    one to the torch step call by call, and to the chunk path on the unrotated score)."""
    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, prefill + 40), generator=torch.Generator().manual_seed(11))
    options = dict(
        budget=24, policy="recall", chunk=8, positions=positions, page_size=3, archive_max=48, kernels="torch"
    )
    if archive == "disk":
        options["archive"] = f"{tmp_path}/"
    if archive == "int8":
        options["archive_bits"] = 8
    fast, slow = H2OCache(model, CacheSettings(**options)), H2OCache(model, CacheSettings(**options))
    for layer in slow.layers:
        layer._step_path = False  # every call on the chunk path
    partly_empty = []

    def note(cache):
        partly_empty.append(cache.layers[0].recalled < cache.policy.recall_slots)

    want = run(model, slow, ids, prefill, 8)
    got = run(model, fast, ids, prefill, 8, note)
    assert step_calls["step"] == 40 * len(fast.layers)  # every decode call of every layer took the step
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for number, (mine, theirs) in enumerate(zip(fast.layers, slow.layers, strict=True)):
        assert torch.equal(mine.recall_index, theirs.recall_index)
        # The first layer gets the same keys (its input is the embedding): its recalled K/V bit for bit.
        exact = dict(rtol=0, atol=0) if number == 0 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.recall_keys, theirs.recall_keys, **exact)
        torch.testing.assert_close(mine.recall_values, theirs.recall_values, **exact)
        for head in range(mine.store.n_kv_heads):
            kept = mine.store.token_index[head][mine.store.valid[head]].sort().values
            assert torch.equal(kept, theirs.store.token_index[head][theirs.store.valid[head]].sort().values)
        assert (mine.recalled, mine.hits, mine.steps) == (theirs.recalled, theirs.hits, theirs.steps)
        assert mine.recalled_total == pytest.approx(theirs.recalled_total)
        assert mine.hits_total == pytest.approx(theirs.hits_total)
    figures = (
        "recalled_per_step",
        "recall_hits",
        "archive_reads_per_step",
        "archive_tokens",
        "archive_reach",
    )
    mine, theirs = fast.archive_summary(), slow.archive_summary()
    assert [getattr(mine, key) for key in figures] == pytest.approx([getattr(theirs, key) for key in figures])
    # The ring wraps during decode; the slots start partly empty with a short prefill only.
    assert mine.archive_reach > 0 and mine.recall_hits > 0
    assert any(partly_empty) == (prefill == 14) and not partly_empty[-1]
    fast.close()
    slow.close()


@pytest.mark.parametrize("positions", ["rolling", "original"])
@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_decode_step_after_chunks_matches_the_naive_simulation(step_calls, positions, ratio):
    """Chunks, then decode by the one-token step: outputs and resident sets follow docs/spec.md literally
    (the naive simulation has no cap, so neither has the archive here; the cap is tested against the chunk
    path above)."""
    torch.manual_seed(12)
    settings = naive_settings(positions, ratio, archive_max=60)
    layer, inv_freq = make_recall_layer(settings)
    feed_against_naive(layer, settings, inv_freq, [9, 9, 5] + [1] * 30, N_HEADS)
    assert step_calls["step"] == 30
    assert layer.archive.oldest == 0 and layer.recalled == layer.policy.recall_slots


@pytest.mark.parametrize("full", [True, False])
def test_rolling_step_positions_rank_each_heads_entries_by_token_index(full):
    """Against the rule written out per head (docs/spec.md): rank E_q = S ∪ R by token index; a head with
    fewer entries is shifted up so that every head's query sits at the same position (the chunk path's)."""
    from h2o_cli.cache.recall.step import rolling_step_positions

    generator = torch.Generator().manual_seed(15)
    for _ in range(20):
        tokens = torch.randperm(200, generator=generator)[: 3 * 14].view(3, 14)  # disjoint S and R per head
        resident, recalled = tokens[:, :6].clone(), tokens[:, 6:].clone()
        resident[:, 0] = 500  # the query's own token, the newest
        if not full:
            recalled[torch.rand(recalled.shape, generator=generator) < 0.4] = -1  # a different count per head
        positions, query_position = rolling_step_positions(resident, recalled, full)
        counts = [6 + int((row >= 0).sum()) for row in recalled]
        assert query_position == max(counts) - 1
        for head in range(3):
            entries = [int(t) for t in torch.cat([resident[head], recalled[head]]) if t >= 0]
            shift = max(counts) - counts[head]
            for column, token in enumerate(torch.cat([resident[head], recalled[head]]).tolist()):
                if token >= 0:
                    assert positions[head, column] == sorted(entries).index(token) + shift


def planted_archive(seed: int, tokens: int, capacity: int = 48, size: int = 4) -> PageArchive:
    """An archive past its ring's wrap whose keys repeat, so that many pages share a bound (ties by age)."""
    generator = torch.Generator().manual_seed(seed)
    archive = PageArchive(N_KV, HEAD_DIM, capacity, PageSettings(size), torch.float32, torch.device("cpu"))
    base = torch.randn(N_KV, 5, HEAD_DIM, generator=generator)
    pick = torch.randint(0, 5, (tokens,), generator=generator)
    keys = base[:, pick]  # tokens drawn from five keys: equal page summaries are common
    keys[:, ::7] = 0.0  # and zero keys: bounds of exactly 0.0 (or -0.0)
    for start in range(0, tokens, 5):
        archive.write(keys[:, start : start + 5], keys[:, start : start + 5])
    return archive


@pytest.mark.parametrize("form", ["choose_one", "choose_fixed"])
@pytest.mark.parametrize("tokens", [9, 30, 75, 130])
@pytest.mark.parametrize("slots", [1, 6, 40])
def test_one_token_choices_are_choose(form, tokens, slots):
    """A one-token call's choice picks `choose`'s tokens in `choose`'s order, the newest token resident:
    `choose_one` (the torch step: S full) and `choose_fixed` (the fixed step: every page scored, S with
    empty slots)."""
    for seed in range(6):
        archive = planted_archive(seed, tokens)
        generator = torch.Generator().manual_seed(100 + seed)
        query = torch.randn(N_KV, 3, HEAD_DIM, generator=generator)
        if seed % 2:
            query = -query.abs()  # negative queries: negative bounds
        resident = torch.stack([torch.randperm(tokens - 1, generator=generator)[:5] for _ in range(N_KV)])
        resident = torch.cat([resident, torch.full((N_KV, 1), tokens - 1)], dim=1)  # the step's own token
        if form == "choose_fixed":
            resident[:, ::3] = -1  # empty slots of S
            resident[:, -1] = tokens - 1
        want, want_valid = archive.choose(query, resident, tokens - 1, slots)
        got, got_valid = getattr(archive, form)(query, resident, slots)
        assert torch.equal(got_valid, want_valid)
        for head in range(N_KV):
            assert torch.equal(got[head][got_valid[head]], want[head][want_valid[head]]), (seed, head)


def test_order_key_orders_pages_as_rank_key():
    """One int64 key gives `rank_key`'s order: larger bound first, ties (also -0.0 and 0.0) to the older page,
    adjacent float32 bounds never crossed, pages without a candidate last."""
    one = torch.tensor(1.0)
    above = torch.nextafter(one, torch.tensor(2.0))
    values = [one, above, one, torch.tensor(float("-inf")), torch.tensor(0.0), -above, torch.tensor(-0.0),
              torch.tensor(-1e-40), torch.tensor(1e-40), torch.tensor(3e38), -one]  # fmt: skip
    bound = torch.stack(values)[None].float()
    page_start = torch.tensor([5, 900, 2, 1, 30, 3, 10, 40, 50, 60, 0])
    candidate = torch.ones_like(bound, dtype=torch.bool)
    candidate[0, 9] = False  # the largest bound, but no candidate: last
    want = torch.argsort(
        rank_key(bound.masked_fill(~candidate, float("-inf")), page_start, 901), descending=True
    )
    got = torch.argsort(order_key(bound, page_start, candidate), descending=True)
    assert got[0, :-2].tolist() == want[0, :-2].tolist()  # the last two: the pages of -inf (either order)
    assert got[0].tolist()[:5] == [1, 2, 0, 8, 6]  # 0.0 (page 30) ties -0.0 (page 10): the older first
    assert got[0, -1] == 9 or got[0, -2] == 9


class ScalarReads(TorchDispatchMode):
    """Counts reads of a tensor's value into Python (`float(t)`, `int(t)`, `.item()`, `bool(t)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_a_full_decode_step_reads_nothing_back_and_the_statistics_wait_until_read(tiny_pair, monkeypatch):
    """With every recall slot filled, a decode call turns no tensor into a Python number (no host sync):
    the statistics are summed as tensors and turned into floats only when read."""
    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(13))
    cache = H2OCache(
        model,
        CacheSettings(budget=16, policy="recall", chunk=8, page_size=2, archive_max=64, recall_ratio=0.5),
    )
    run(model, cache, ids[:, :60], 60, 8)
    counter = ScalarReads()
    for name in ("update", "attend"):  # the cache's own calls, not the model's
        inner = getattr(RecallLayer, name)

        def counted(self, *args, _inner=inner, **kwargs):
            with counter:
                return _inner(self, *args, **kwargs)

        monkeypatch.setattr(RecallLayer, name, counted)
    with torch.inference_mode():
        for step in range(60, 70):
            model(ids[:, step : step + 1], cache=cache)
    assert counter.reads == 0
    layer = cache.layers[1]
    assert layer.recalled == 8.0 and layer.steps == 8 + 10 and 0 <= layer.hits <= 8.0 < layer.hits_total


def test_a_recall_decode_call_stays_within_its_op_budget(tiny_pair):
    """A full decode call of a layer (not the first: the pass's maps exist), a page starting, computes with at
    most 112 tensor ops (108 now); the chunk path takes 168 for the same call (ops bound the step)."""
    from test_decode_step import OpCounter

    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 63), generator=torch.Generator().manual_seed(13))
    cache = H2OCache(
        model,
        CacheSettings(budget=16, policy="recall", chunk=8, page_size=2, archive_max=64, recall_ratio=0.5),
    )
    run(model, cache, ids[:, :62], 60, 8)
    layer, counter = cache.layers[1], OpCounter()
    for name in ("update", "attend"):
        inner = getattr(layer, name)

        def counted(*args, _inner=inner, **kwargs):
            with counter:
                return _inner(*args, **kwargs)

        setattr(layer, name, counted)
    with torch.inference_mode():
        model(ids[:, 62:63], cache=cache)
    assert layer.archive.tokens == 63 and layer.recalled == 8.0  # a page started; the slots are full
    assert sum(counter.ops.values()) <= 112, dict(counter.ops)


def test_held_tokens_stay_exact_after_a_rewind_past_dropped_pages():
    """`recall_is_full` counts on `held()`: after a scorer's rewind the ring holds fewer tokens than its reach
    (pages dropped for the forgotten tokens do not come back), and `oldest`/`held` say so."""
    archive = PageArchive(N_KV, HEAD_DIM, 12, PageSettings(3), torch.float32, torch.device("cpu"))
    archive.write(torch.randn(N_KV, 30, HEAD_DIM), torch.randn(N_KV, 30, HEAD_DIM))
    for rewind_to, kept in ((25, range(18, 25)), (19, [18]), (10, [])):
        archive.rewind(rewind_to)
        held = sorted(t for t in archive.token_index.tolist() if t >= 0)
        assert held == list(kept) and archive.held() == len(held)
        assert archive.oldest == (held[0] if held else rewind_to)
    archive.write(torch.randn(N_KV, 4, HEAD_DIM), torch.randn(N_KV, 4, HEAD_DIM))  # tokens 10..13
    assert archive.oldest == 10 and archive.held() == 4
