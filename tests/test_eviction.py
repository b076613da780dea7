"""Eviction decisions and attention of H2OLayer against the naive SPEC.md simulation, on random Q/K/V."""

from __future__ import annotations

import pytest
import torch
from conftest import feed_against_naive, feed_chunk, tiny_config
from naive import NaiveHeadState, inv_freq_of, naive_attend_chunk
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from h2o_cli.cache import H2OLayer
from h2o_cli.cache.positions import Rope
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings

N_HEADS, N_KV, HEAD_DIM = 6, 2, 16

SETTINGS = [
    dict(policy="h2o", positions="rolling"),
    dict(policy="h2o", positions="original"),
    dict(policy="h2o", positions="rolling", score_norm="mean"),
    dict(policy="h2o", positions="rolling", heavy_ratio=1.0),
    dict(policy="h2o", positions="rolling", heavy_ratio=0.6),  # round(4.8): a split where rounding matters
    dict(policy="h2o", positions="rolling", score_decay=0.7),
    dict(policy="h2o", positions="original", score_decay=0.9, h2o_sinks=2),
    dict(policy="h2o", positions="rolling", h2o_sinks=3),
    dict(policy="local", positions="rolling"),
    dict(policy="sink", positions="rolling", sinks=3),
    dict(policy="tova", positions="original"),
    dict(policy="full", positions="original"),
]


def make_layer(settings: CacheSettings) -> tuple[H2OLayer, torch.Tensor]:
    config = tiny_config(
        hidden_size=N_HEADS * HEAD_DIM, num_attention_heads=N_HEADS, num_key_value_heads=N_KV
    )
    rotary = LlamaRotaryEmbedding(config)
    budget = config.max_position_embeddings if settings.policy == "full" else settings.budget
    store = LayerStore(N_KV, HEAD_DIM, budget, settings.chunk, torch.float64, torch.device("cpu"))
    return H2OLayer(store, settings, Rope(rotary, HEAD_DIM), config.max_position_embeddings), inv_freq_of(
        config, HEAD_DIM
    )


@pytest.mark.parametrize("overrides", SETTINGS, ids=lambda o: "-".join(str(v) for v in o.values()))
@pytest.mark.parametrize("chunks", [[1] * 40, [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6]], ids=["decode", "chunked"])
def test_layer_matches_naive_simulation(overrides, chunks):
    torch.manual_seed(1)
    settings = CacheSettings(budget=8, chunk=9, **overrides)
    layer, inv_freq = make_layer(settings)

    def ranks_are_a_permutation(store) -> None:
        ranks = store.rank.masked_select(store.valid).view(N_KV, -1)
        assert sorted(ranks[0].tolist()) == list(range(store.length))

    feed_against_naive(layer, settings, inv_freq, chunks, N_HEADS, ranks_are_a_permutation)
    if settings.policy != "full":
        assert layer.store.length == settings.budget


def test_worked_example_evicts_and():
    """The seed's example: accumulated scores 1.4, 1.5, 0.5, 0.6 with one recent slot → "and" is evicted."""
    from h2o_cli.policies import make_policy

    tokens = ["Heavy", "hitters", "and", "recent"]
    store = LayerStore(1, 4, budget=3, chunk=1, dtype=torch.float32, device=torch.device("cpu"))
    store.write(torch.zeros(1, 4, 4), torch.zeros(1, 4, 4))
    store.scores[0, :4] = torch.tensor([1.4, 1.5, 0.5, 0.6])
    evicted = store.evict(make_policy(CacheSettings(budget=3, heavy_ratio=2 / 3, chunk=1)))
    assert tokens[int(store.token_index.new_tensor(0) + evicted[0, 0])] == "and"
    assert sorted(store.token_index[0][store.valid[0]].tolist()) == [0, 1, 3]


def test_ties_go_to_the_oldest():
    from h2o_cli.policies import select_evictions

    priority = torch.tensor([[0.5, 0.2, 0.2, 0.9, 0.2]])
    token_index = torch.tensor([[10, 7, 3, 1, 5]])
    assert select_evictions(priority, token_index, 1).tolist() == [[2]]
    assert select_evictions(priority, token_index, 3).tolist() == [[2, 4, 1]]


def test_one_eviction_never_picks_an_empty_slot_when_every_priority_is_never():
    """Regression: with every valid priority inf, the fast path picked the empty slot (token_index -1)."""
    from dataclasses import dataclass

    from h2o_cli.policies import select_evictions
    from h2o_cli.policies.base import NEVER

    priority = torch.full((2, 4), NEVER)
    token_index = torch.tensor([[5, 6, -1, 7], [-1, 9, 8, 10]])
    assert select_evictions(priority, token_index, 1).tolist() == [[0], [2]]
    assert (
        select_evictions(priority, token_index, 1).tolist()
        == select_evictions(priority, token_index, 2)[:, :1].tolist()
    )

    @dataclass(frozen=True)
    class ProtectEverything:  # a policy whose every entry is never-evict, but which must still evict
        evicts: bool = True

        def priority(self, state):
            return torch.full_like(state.scores, NEVER)

    store = LayerStore(1, 4, budget=2, chunk=2, dtype=torch.float32, device=torch.device("cpu"))
    store.write(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))  # slot 3 stays empty
    store.evict(ProtectEverything())
    assert store.length == 2 and int(store.valid.sum()) == 2
    assert sorted(store.token_index[0][store.valid[0]].tolist()) == [1, 2]


@pytest.mark.parametrize("overrides", SETTINGS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_calls_longer_than_the_spare_equal_the_naive_reference_in_sub_chunks(overrides):
    """Regression: with 3 spare slots, calls of up to 9 tokens are split by the layer into sub-chunks that fit
    its free slots (budget + spare - held), and equal the naive reference fed those sub-chunks; the buffers
    never move or grow."""
    torch.manual_seed(1)
    settings = CacheSettings(budget=8, chunk=3, **overrides)
    layer, inv_freq = make_layer(settings)
    store = layer.store
    layout = [(getattr(store, name).data_ptr(), getattr(store, name).shape) for name in store._state_names()]
    heads = [NaiveHeadState() for _ in range(N_KV)]
    start = 0
    for c in [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6, 9]:
        q = torch.randn(N_HEADS, c, HEAD_DIM, dtype=torch.float64) * 2
        k = torch.randn(N_KV, c, HEAD_DIM, dtype=torch.float64) * 2
        v = torch.randn(N_KV, c, HEAD_DIM, dtype=torch.float64)
        got = feed_chunk(layer, q, k, v, start)
        wants, done = [], 0
        while done < c:
            size = min(c - done, store.slots - len(heads[0].alive_indices()))
            part = slice(done, done + size)
            wants.append(
                naive_attend_chunk(
                    heads,
                    q[:, part],
                    k[:, part],
                    v[:, part],
                    start + done,
                    settings,
                    inv_freq,
                    HEAD_DIM**-0.5,
                )
            )
            done += size
        torch.testing.assert_close(got, torch.cat(wants, dim=1), rtol=1e-5, atol=1e-5)
        start += c
        for j, head in enumerate(heads):
            assert sorted(store.token_index[j][store.valid[j]].tolist()) == head.alive_indices()
    assert [
        (getattr(store, name).data_ptr(), getattr(store, name).shape) for name in store._state_names()
    ] == layout
