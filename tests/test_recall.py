"""The `recall` policy (docs/spec.md): the naive simulation, the exactness anchors, past the window, its settings' checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import feed_against_naive, run_stream, tiny_config
from naive import inv_freq_of, resident_budget
from naive import rope as naive_rope
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from h2o_cli.cache import H2OCache, RecallLayer
from h2o_cli.cache.positions import Rope, rotate
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError

N_HEADS, N_KV, HEAD_DIM = 6, 2, 16


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
    store = LayerStore(
        N_KV, HEAD_DIM, resident_budget(settings), settings.chunk, torch.float64, torch.device("cpu")
    )
    layer = RecallLayer(
        store, settings, Rope(LlamaRotaryEmbedding(config), HEAD_DIM), config.max_position_embeddings
    )
    layer.add_archive(settings.archive_max, torch.float64, torch.device("cpu"))
    return layer, inv_freq_of(config, HEAD_DIM)


@pytest.mark.parametrize("positions", ["rolling", "original"])
# 0.125: |S| = 7, heavy = round(3.5); 0.9: round(7.2) recalled slots would leave 1 resident, so 6 (|S| = 2)
@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.125, 0.9])
@pytest.mark.parametrize("chunks", [[1] * 40, [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6]], ids=["decode", "chunked"])
def test_recall_layer_matches_the_naive_simulation(positions, ratio, chunks):
    """Outputs, the resident set and the recalled tokens follow docs/spec.md literally (tests/naive.py)."""
    torch.manual_seed(2)
    settings = naive_settings(positions, ratio, archive_max=96)
    layer, inv_freq = make_recall_layer(settings)
    feed_against_naive(layer, settings, inv_freq, chunks, N_HEADS)
    store = layer.store
    assert layer.recalled > 0 and store.length == layer.policy.resident


def test_a_full_recall_set_is_read_with_s_in_rank_order():
    """Where every head's R is full and positions roll, the chunk path reads S ∪ R gathered in rank order
    (`merged_order`): every entry once, in token order, R's columns among S's; with an empty recall slot, or
    token-index positions, it reads R first at its positions (None here)."""
    torch.manual_seed(2)
    settings = naive_settings("rolling", 0.5, archive_max=96)
    layer, inv_freq = make_recall_layer(settings)
    feed_against_naive(layer, settings, inv_freq, [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6], N_HEADS)
    store, recall = layer.store, layer.recall_index.shape[1]
    assert bool((layer.recall_index >= 0).all())
    order = layer.merged_order(6)
    assert order.shape == (N_KV, store.length + recall)
    columns = torch.cat([store.token_index[:, : store.active], layer.recall_index], dim=1)
    assert bool((columns.gather(1, order).diff(dim=1) > 0).all())
    assert bool((order >= store.active).sum(dim=1).eq(recall).all())
    layer.positions = "original"
    assert layer.merged_order(6) is None
    layer.positions = "rolling"
    layer.recall_index[1, 0] = -1
    assert layer.merged_order(6) is None


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
    assert (
        cache.length == resident_budget(settings) and cache.archive_summary().recalled_per_step > 0
    )  # evicted, then recalled


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
    """Anchor on the real model: budget 256 over a 240-token stream (at the default split, S = 64 resident and 192
    recall slots, room for every evicted token) is `full`, with each head's own choice of pages or the lead's
    (`--lead-text`)."""
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
    assert (
        results[1].error is None
        and cache.length == resident_budget(settings)
        and cache.archive_summary().recalled_per_step > 0
    )
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
