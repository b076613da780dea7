"""The `recall` policy (docs/spec.md): the naive simulation, the exactness anchors, the page choice, the cap."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import feed_against_naive, run_stream, tiny_config
from naive import inv_freq_of
from naive import rope as naive_rope
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from h2o_cli.cache import H2OCache, RecallLayer
from h2o_cli.cache.positions import Rope, rotate
from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError

N_HEADS, N_KV, HEAD_DIM = 6, 2, 16


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


def naive_settings(
    positions: str, ratio: float, archive_max: int, page_score: str = "positional"
) -> CacheSettings:
    """The small recall cache the layer-vs-naive tests share: budget 8, chunks up to 9, pages of 3."""
    return CacheSettings(
        budget=8,
        chunk=9,
        policy="recall",
        positions=positions,
        recall_ratio=ratio,
        page_size=3,
        archive_max=archive_max,
        page_score=page_score,
    )


def make_recall_layer(settings: CacheSettings) -> tuple[RecallLayer, torch.Tensor]:
    config = tiny_config(
        hidden_size=N_HEADS * HEAD_DIM, num_attention_heads=N_HEADS, num_key_value_heads=N_KV
    )
    policy_budget = settings.budget - round(settings.budget * settings.recall_ratio)
    store = LayerStore(N_KV, HEAD_DIM, policy_budget, settings.chunk, torch.float64, torch.device("cpu"))
    layer = RecallLayer(
        store, settings, Rope(LlamaRotaryEmbedding(config), HEAD_DIM), config.max_position_embeddings
    )
    layer.add_archive(settings.archive_max, torch.float64, torch.device("cpu"))
    return layer, inv_freq_of(config, HEAD_DIM)


@pytest.mark.parametrize("positions", ["rolling", "original"])
@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.125])  # 0.125: |S| = 7, heavy = round(3.5)
@pytest.mark.parametrize("chunks", [[1] * 40, [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6]], ids=["decode", "chunked"])
def test_recall_layer_matches_the_naive_simulation(positions, ratio, chunks):
    """Outputs, the resident set and the recalled tokens follow docs/spec.md literally (tests/naive.py)."""
    torch.manual_seed(2)
    settings = naive_settings(positions, ratio, archive_max=96)
    layer, inv_freq = make_recall_layer(settings)
    feed_against_naive(layer, settings, inv_freq, chunks, N_HEADS)
    store = layer.store
    assert layer.recalled > 0 and store.length == layer.policy.resident


@pytest.mark.parametrize(
    "ratio, heavy", [(0.5, 0.5), (0.125, 0.5), (0.5, 1.0)], ids=["half", "small-r", "no-recent"]
)
@pytest.mark.parametrize("chunks", [[1] * 40, [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6]], ids=["decode", "chunked"])
def test_contiguous_placement_matches_the_naive_simulation(ratio, heavy, chunks):
    """`--recall-place contiguous`: R ranked as one block between S's older entries and its recent window
    (with no recent window, before the call's own tokens), on the chunk path and the torch step."""
    torch.manual_seed(4)
    settings = dataclasses.replace(
        naive_settings("rolling", ratio, archive_max=96), heavy_ratio=heavy, recall_place="contiguous"
    )
    layer, inv_freq = make_recall_layer(settings)
    feed_against_naive(layer, settings, inv_freq, chunks, N_HEADS)
    assert layer.recalled > 0


@pytest.mark.parametrize("positions", ["rolling", "original"])
@pytest.mark.parametrize(
    "pages",
    [
        dict(page_size=1),
        dict(page_size=3),
        dict(page_size=6, block_size=2, shortlist=2),
        dict(page_size=6, block_size=2, shortlist=2, page_carry=0.9),
        dict(page_size=6, block_size=2, shortlist=4, step_shortlist=2, page_carry=0.9),
        dict(page_size=3, page_carry=0.9, choice_tokens=3),
        dict(page_size=3, page_carry=0.9, recall_place="contiguous"),
    ],
    ids=["page-1", "page-3", "page-6-shortlist-2", "carried", "step-shortlist", "sampled", "contiguous"],
)
@pytest.mark.parametrize(
    "chunks",
    [[1] * 40, [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6], [9, 7, (9, 4), 1, 1, 1, (8, 3), 1, 1, 6]],
    ids=["decode", "chunked", "asked"],
)
def test_attention_page_score_matches_the_naive_simulation(positions, pages, chunks):
    """`--page-score attention`: pages ranked by the softmax mass the queries put on their keys, over every
    archived key, or over those of the `--shortlist` pages the summaries bound best (a step: the
    `--step-shortlist` its last scores rank best), plus `--page-carry` of each page's last score (docs/spec.md), on the chunk path and the torch step; `asked`: chunks that end in a
    question, whose queries alone choose (weighed as its tokens)."""
    torch.manual_seed(9)
    settings = dataclasses.replace(
        naive_settings(positions, 0.75, archive_max=96, page_score="attention"), **pages
    )
    layer, inv_freq = make_recall_layer(settings)
    assert layer.archive.attention
    feed_against_naive(layer, settings, inv_freq, chunks, N_HEADS)
    assert layer.recalled > 0


@pytest.mark.parametrize("positions", ["rolling", "original"])
@pytest.mark.parametrize("block_size", [1, 2, 3])
@pytest.mark.parametrize("chunks", [[1] * 40, [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6]], ids=["decode", "chunked"])
def test_pages_ranked_by_their_best_block_match_the_naive_simulation(positions, block_size, chunks):
    """`--block-size`: pages of 6 read back whole, each ranked by the best of its blocks' bounds (docs/spec.md),
    the newest page's unwritten blocks bounding nothing (tests/test_native_recall.py wraps the ring)."""
    torch.manual_seed(7)
    settings = dataclasses.replace(
        naive_settings(positions, 0.75, archive_max=96), page_size=6, block_size=block_size
    )
    layer, inv_freq = make_recall_layer(settings)
    assert layer.archive.summary.shape[1] == 96 // block_size
    feed_against_naive(layer, settings, inv_freq, chunks, N_HEADS)
    assert layer.recalled > 0


@pytest.mark.parametrize("positions", ["rolling", "original"])
@pytest.mark.parametrize("chunks", [[1] * 40, [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6]], ids=["decode", "chunked"])
def test_decayed_recall_matches_the_naive_simulation(positions, chunks):
    """`--score-decay` with recall: S's scores decay as h2o's, per query token (docs/spec.md), on the chunk
    path and the torch step alike (the layer here is float64: no C step)."""
    torch.manual_seed(5)
    settings = dataclasses.replace(naive_settings(positions, 0.5, archive_max=96), score_decay=0.8)
    layer, inv_freq = make_recall_layer(settings)
    feed_against_naive(layer, settings, inv_freq, chunks, N_HEADS)
    assert layer.recalled > 0 and layer.policy.decay_per_query == 0.8


@pytest.mark.parametrize("positions", ["rolling", "original"])
def test_unrotated_page_score_matches_the_naive_simulation(positions):
    """`--page-score unrotated` (Quest's score: the query as it is) against the naive simulation's."""
    torch.manual_seed(3)
    settings = naive_settings(positions, 0.5, archive_max=96, page_score="unrotated")
    layer, inv_freq = make_recall_layer(settings)
    feed_against_naive(layer, settings, inv_freq, [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6], N_HEADS)
    assert layer.recalled > 0


def test_positional_page_score_is_the_mean_logit_over_the_distances():
    """`rotate(q, *Rope.mean_rotation(low, high)) . k` is the mean over d in [low, high) of RoPE's logit of q
    and k d positions apart (naive rotations in float64, at an arbitrary key position)."""
    torch.manual_seed(4)
    config = tiny_config(
        hidden_size=N_HEADS * HEAD_DIM, num_attention_heads=N_HEADS, num_key_value_heads=N_KV
    )
    rope_ = Rope(LlamaRotaryEmbedding(config), HEAD_DIM)
    inv_freq = inv_freq_of(config, HEAD_DIM)
    query, key = torch.randn(HEAD_DIM, dtype=torch.float64), torch.randn(HEAD_DIM, dtype=torch.float64)
    low, high, at = 3, 40, 17
    logits = [
        float(
            naive_rope(query[None], torch.tensor([at + d]), inv_freq)[0]
            @ naive_rope(key[None], torch.tensor([at]), inv_freq)[0]
        )
        for d in range(low, high)
    ]
    scored = rotate(query.float(), *rope_.mean_rotation(low, high, torch.device("cpu"))).double() @ key
    assert float(scored) == pytest.approx(sum(logits) / len(logits), rel=1e-5, abs=1e-5)
    assert abs(float(query @ key) - sum(logits) / len(logits)) > 1e-3  # the unrotated score differs


@pytest.mark.parametrize("positions", ["original", "rolling"])
@pytest.mark.parametrize("chunk", [1, 7])
def test_recall_with_room_for_every_token_equals_plain_transformers(tiny_pair, positions, chunk):
    """Anchor: r covers every evicted token, so E_q is every token <= q (the full attention)."""
    reference, model = tiny_pair
    ids = torch.randint(0, 128, (1, 61), generator=torch.Generator().manual_seed(3))
    settings = CacheSettings(budget=64, policy="recall", chunk=chunk, positions=positions, page_size=4)
    cache = H2OCache(model, settings)
    with torch.no_grad():
        want = reference(ids).logits
        got = torch.cat([model(ids[:, s : s + chunk], cache=cache).logits for s in range(0, 61, chunk)], 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cache.length == 32 and cache.archive_summary().recalled_per_step > 0  # evicted, then recalled


@pytest.mark.parametrize("chunk", [1, 5])
def test_recall_without_recall_slots_equals_h2o(tiny_pair, chunk):
    """Anchor: with r = 0 the resident set, its scores and the logits are h2o's."""
    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(4))
    caches = [
        H2OCache(
            model, CacheSettings(budget=12, policy=policy, chunk=chunk, heavy_ratio=0.25, recall_ratio=0.0)
        )
        for policy in ("h2o", "recall")
    ]
    with torch.no_grad():
        logits = [
            torch.cat([model(ids[:, s : s + chunk], cache=cache).logits for s in range(0, 50, chunk)], 1)
            for cache in caches
        ]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for h2o_store, recall_store in zip(caches[0].stores, caches[1].stores, strict=True):
        assert torch.equal(h2o_store.token_index, recall_store.token_index)
        torch.testing.assert_close(recall_store.scores, h2o_store.scores)


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


def test_recall_past_the_models_window_with_rolling_positions(tiny_pair):
    """A 600-token stream through a 256-position model: positions stay below budget + chunk, and tokens from
    before position 256 are still recalled at the end."""
    _, model = tiny_pair
    settings = CacheSettings(budget=64, policy="recall", chunk=8, page_size=8, archive_max=1024)
    ids = torch.randint(0, 128, (1, 600), generator=torch.Generator().manual_seed(7))
    logits, cache = run_stream(model, settings, ids, 8)
    assert torch.isfinite(logits[:, -8:]).all() and cache.tokens_seen == 600
    early = [int((layer.recall_index[(layer.recall_index >= 0)] < 256).sum()) for layer in cache.layers]
    assert sum(early) > 0, "no token from before the model's window was recalled"
    assert cache.archive_summary().archive_oldest == 0
    assert cache.layers[0].rope._cos.shape[0] <= 2 * (64 + 8)  # positions never went past budget + chunk


@pytest.mark.parametrize(
    ("values", "words"),
    [
        (dict(recall_ratio=-0.1), "--recall-ratio -0.1 must lie in [0, 1]"),
        (dict(recall_ratio=1.5), "--recall-ratio 1.5 must lie in [0, 1]"),
        (dict(recall_ratio=float("nan")), "--recall-ratio nan"),
        (dict(page_size=0), "--page-size 0 must be at least 1"),
        (dict(choice_tokens=-1), "--choice-tokens -1 must be 0"),
        (dict(archive_max=10, page_size=16), "--archive-max 10 must hold at least two pages"),
        (dict(recall_ratio=0.95, budget=20), "leaves 1 resident token"),
        (dict(score_decay=0.99, score_norm="mean"), "--score-decay below 1 works with --score-norm sum only"),
        (dict(recall_place="middle"), "--recall-place 'middle' is unknown; choose index, contiguous"),
        (dict(recall_layers="6-"), "--recall-layers '6-': give all, or layer numbers and ranges from 0"),
        (dict(recall_layers="5-3"), "--recall-layers '5-3': give all"),
        (dict(recall_layers=""), "--recall-layers '': give all"),
        (
            dict(page_score="rotated"),
            "--page-score 'rotated' is unknown; choose positional, unrotated, attention",
        ),
    ],
)
def test_bad_recall_settings_are_usage_errors(values, words):
    with pytest.raises(UsageError, match=words.replace("[", r"\[").replace("]", r"\]")):
        CacheSettings(**{"budget": 64, "policy": "recall", **values})


def test_recall_layers_past_the_model_are_a_usage_error():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config()).eval()
    with pytest.raises(UsageError, match=r"--recall-layers '0,2' names layer 2, but the model has 2 \(0-1\)"):
        H2OCache(model, CacheSettings(budget=16, chunk=8, policy="recall", recall_layers="0,2"))


@pytest.mark.parametrize("lead_text", [False, True])
def test_recall_with_room_for_every_token_equals_full_on_the_embedded_model(smollm, excerpt, lead_text):
    """Anchor on the real model: budget 256 over a 240-token stream (S = 128 + 128 recalled) is `full`, with
    each head's own choice of pages or the lead's (`--lead-text`)."""
    from h2o_cli.streaming import stream_perplexity

    model, tokenizer = smollm
    ids = tokenizer(excerpt)["input_ids"][:240]
    results = []
    for settings in (
        CacheSettings(budget=256, policy="full", chunk=32, positions="original"),
        CacheSettings(budget=256, policy="recall", chunk=32, positions="rolling", lead_text=lead_text),
    ):
        cache = H2OCache(model, settings, span=len(ids))
        results.append(stream_perplexity(model, cache, [ids], 32))
    assert results[1].error is None and cache.length == 128 and cache.archive_summary().recalled_per_step > 0
    assert results[1].ppl == pytest.approx(results[0].ppl, rel=1e-4)


def test_eval_scorer_rewinds_the_archive_between_continuations(tiny_pair):
    """Scoring B after A (from the scorer's snapshot) equals scoring B alone: A's tokens leave the archive."""
    from h2o_cli.eval.scoring import continuation_scores

    _, model = tiny_pair
    settings = CacheSettings(budget=8, policy="recall", chunk=2, page_size=2)
    context, continuations = list(range(3, 30)), [[5, 6, 7, 8, 9, 1, 2], list(range(40, 56))]
    both = continuation_scores(model, H2OCache(model, settings, span=50), context, continuations, 2)
    alone = continuation_scores(model, H2OCache(model, settings, span=50), context, continuations[1:], 2)
    assert both[1][0] == pytest.approx(alone[0][0], rel=1e-6, abs=1e-6)


def test_rank_key_orders_by_bound_then_age_without_crossing_adjacent_floats():
    """The one-`topk` page order: larger bound first; equal bounds older page first; adjacent float32 bounds
    keep their order whatever the pages' ages (the tie-break stays under half an ulp)."""
    one = torch.tensor(1.0)
    above = torch.nextafter(one, torch.tensor(2.0))
    bound = torch.stack([one, above, one, torch.tensor(float("-inf")), torch.tensor(0.0), -above])[None]
    page_start = torch.tensor([5, 900, 2, 1, 0, 3])  # page 1 is the youngest, yet its bound is larger
    order = torch.argsort(rank_key(bound, page_start, tokens=901), dim=1, descending=True)[0].tolist()
    assert order == [1, 2, 0, 4, 5, 3]
