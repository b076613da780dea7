"""The torch decode step (h2o_cli.cache.step) against independent references: float64 RoPE and softmax
written out, the policy's own eviction rule, and an op budget that keeps the step small."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from conftest import feed_chunk, tiny_config
from h2o_kernels.reference import lowest_outside_recent
from naive import NaiveHeadState, inv_freq_of, naive_attend_chunk, rope
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from h2o_cli.cache import H2OLayer
from h2o_cli.cache.positions import Rope, rotate, unrotate
from h2o_cli.cache.step import DecodeMaps, expand, one_thread, step_attention
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings
from h2o_cli.policies import make_policy, select_evictions

N_HEADS, N_KV, HEAD_DIM = 6, 2, 16


def make_rope() -> tuple[Rope, torch.Tensor]:
    config = tiny_config(
        hidden_size=N_HEADS * HEAD_DIM, num_attention_heads=N_HEADS, num_key_value_heads=N_KV
    )
    return Rope(LlamaRotaryEmbedding(config), HEAD_DIM), inv_freq_of(config, HEAD_DIM)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("slots", [1, 37])
def test_step_attention_matches_rope_and_softmax_written_out(dtype, slots):
    """Attention of one query per head (GQA) against RoPE in float64 and the softmax written out."""
    torch.manual_seed(0)
    rope_tables, inv_freq = make_rope()
    query = torch.randn(N_HEADS, HEAD_DIM, dtype=dtype) * 2  # unrotated
    keys = torch.randn(N_KV, slots, HEAD_DIM, dtype=dtype) * 2
    values = torch.randn(N_KV, slots, HEAD_DIM, dtype=dtype)
    key_positions = torch.randint(0, 50, (N_KV, slots))
    query_position, scaling = 61, HEAD_DIM**-0.5
    cos, sin = rope_tables.table(64, dtype, torch.device("cpu"))
    at = slice(query_position, query_position + 1)
    grouped = (expand(rotate(query, cos[at], sin[at])) * scaling).view(N_KV, -1, 2 * HEAD_DIM)

    output, probs = step_attention(
        grouped, keys, values, key_positions, rope_tables.step_table(64, dtype, torch.device("cpu"))
    )

    group = N_HEADS // N_KV
    for head in range(N_HEADS):
        kv = head // group
        q = rope(query[head : head + 1], torch.tensor([query_position]), inv_freq)
        k = rope(keys[kv], key_positions[kv], inv_freq)
        want = torch.softmax((q @ k.T)[0] * scaling, dim=-1)
        torch.testing.assert_close(probs[kv, head % group].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            output[kv, head % group].double(), want @ values[kv].double(), rtol=1e-5, atol=1e-5
        )


def test_maps_are_the_rotations_they_stand_for():
    torch.manual_seed(0)
    rope_tables, _ = make_rope()
    cos_table, sin_table = rope_tables.table(64, torch.float64, torch.device("cpu"))
    cos, sin = rope_tables.cos_sin(torch.tensor([23]), torch.float64)
    maps = DecodeMaps()
    x = torch.randn(5, HEAD_DIM, dtype=torch.float64)
    torch.testing.assert_close(x @ maps.unrotation(cos, sin), unrotate(x, cos, sin))
    query_map = maps.query(cos, sin, 7, 0.5, cos_table, sin_table)
    want = expand(rotate(unrotate(x, cos, sin), cos_table[7:8], sin_table[7:8])) * 0.5
    torch.testing.assert_close(x @ query_map, want)
    assert maps.query(cos, sin, 7, 0.5, cos_table, sin_table) is query_map  # once per forward pass
    assert maps.usable(cos_table, sin_table)
    # A rotation whose halves differ is not the rotate_half RoPE the step's tables assume: refused.
    odd = cos_table.clone()
    odd[:, -1] += 0.5
    assert not DecodeMaps().usable(odd, sin_table)


@pytest.mark.parametrize("recent", [0, 1, 3, 6])
def test_lowest_outside_recent_is_the_policy_choice(recent):
    torch.manual_seed(recent)
    policy = make_policy(CacheSettings(budget=6, heavy_ratio=(6 - recent) / 6).resolved(64))
    assert policy.kernel_victim and policy.recent_slots == recent
    for trial in range(30):
        store = LayerStore(3, 4, budget=6, chunk=6, dtype=torch.float32, device=torch.device("cpu"))
        store.write(torch.zeros(3, 9, 4), torch.zeros(3, 9, 4))
        store.drop(torch.stack([torch.randperm(9)[:2] for _ in range(3)]))  # holes, ranks shifted
        # With holes (the fused decode kernel's form, `valid` given), one entry over the budget:
        store.write(torch.zeros(3, 1, 4), torch.zeros(3, 1, 4))
        store.scores.copy_(torch.randint(0, 3, store.scores.shape).float())  # many ties
        want = select_evictions(policy.priority(store), store.token_index, 1)
        limit = store.length - recent
        got = lowest_outside_recent(store.scores, store.rank, limit, store.valid)
        assert torch.equal(got, want if limit > 0 else torch.full_like(want, -1)), f"trial {trial}"
        store.drop(want)
        store.compact()  # what a decode step does first: the 7 entries in slots 0..6
        store.write(torch.zeros(3, 1, 4), torch.zeros(3, 1, 4))  # 8 entries: one over the budget
        store.scores.copy_(torch.randint(0, 3, store.scores.shape).float())  # many ties
        want = select_evictions(policy.priority(store), store.token_index, 1)
        active = store.active
        got = lowest_outside_recent(store.scores[:, :active], store.rank[:, :active], store.length - recent)
        assert torch.equal(got, want), f"trial {trial}"


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that compute (views and no-op casts aside)."""

    VIEWS = {"view", "alias", "slice", "select", "unsqueeze", "expand", "transpose", "reshape", "as_strided",
             "t", "chunk", "split", "detach", "_unsafe_view", "to", "squeeze", "permute"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def test_one_token_call_stays_within_its_op_budget():
    """A full cache's decode call of a layer (not the first: the pass's maps exist) computes with at most
    36 tensor ops (33 now); the chunk path took 62 for the same call (ops bound the step)."""
    torch.manual_seed(0)
    rope_tables, _ = make_rope()
    settings = CacheSettings(budget=8, chunk=4, kernels="torch").resolved(256)  # the C step: test_native_step
    maps = DecodeMaps()
    layers = [
        H2OLayer(LayerStore(N_KV, HEAD_DIM, 8, 4, torch.float32, torch.device("cpu")), settings, rope_tables, 256,
                 first_layer=number == 0, maps=maps)
        for number in range(2)
    ]  # fmt: skip
    with torch.inference_mode():
        for start in range(0, 20):
            positions = torch.tensor([start])
            cos, sin = rope_tables.cos_sin(positions, torch.float32)
            q, k, v = (
                rotate(torch.randn(N_HEADS, 1, HEAD_DIM), cos, sin)[None],
                rotate(torch.randn(N_KV, 1, HEAD_DIM), cos, sin)[None],
                torch.randn(1, N_KV, 1, HEAD_DIM),
            )  # as the model hands them over: q and k rotated at the token's position
            kwargs = {"position_ids": positions[None]}
            counter = OpCounter()
            for layer in layers:
                with counter if layer is layers[1] else contextlib.nullcontext():
                    layer.update(k, v, kwargs=kwargs)
                    layer.attend(q, HEAD_DIM**-0.5)
    assert layers[1].store.length == 8
    assert sum(counter.ops.values()) <= 36, dict(counter.ops)


def test_one_thread_scope_restores_the_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError), one_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_decode_layer_matches_naive_with_float32_store(kernels):
    """The step in the model's dtype (the layer-vs-naive tests run float64) against the naive simulation, on
    the torch path and as the C function (h2o_kernels.native; it runs once the cache is full)."""
    torch.manual_seed(3)
    rope_tables, inv_freq = make_rope()
    settings = CacheSettings(budget=8, chunk=9, kernels=kernels).resolved(256)
    store = LayerStore(N_KV, HEAD_DIM, 8, 9, torch.float32, torch.device("cpu"))
    layer = H2OLayer(store, settings, rope_tables, 256)
    heads = [NaiveHeadState() for _ in range(N_KV)]
    start = 0
    for chunk in [5, 9] + [1] * 30:
        q = torch.randn(N_HEADS, chunk, HEAD_DIM) * 2
        k = torch.randn(N_KV, chunk, HEAD_DIM) * 2
        v = torch.randn(N_KV, chunk, HEAD_DIM)
        got = feed_chunk(layer, q, k, v, start)
        want = naive_attend_chunk(heads, q.double(), k.double(), v.double(), start, settings, inv_freq,
                                  HEAD_DIM**-0.5)  # fmt: skip
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
        for j, head in enumerate(heads):
            assert sorted(store.token_index[j][store.valid[j]].tolist()) == head.alive_indices()
        start += chunk
    assert (layer._c_buffers is not None) == (kernels == "native")


def test_compact_moves_entries_below_length_and_keeps_every_value():
    """A chunk's evictions leave holes; `compact` closes them once (a pure permutation of the slots)."""
    torch.manual_seed(0)
    store = LayerStore(2, 4, budget=5, chunk=6, dtype=torch.float32, device=torch.device("cpu"))
    keys, values = torch.randn(2, 11, 4), torch.randn(2, 11, 4)
    store.write(keys, values)
    store.scores.copy_(torch.rand(2, 11))
    store.drop(torch.tensor([[0, 3, 4, 7, 9, 10], [1, 2, 5, 6, 8, 9]]))  # 5 entries left per head
    before = {
        name: [getattr(store, name)[head][store.valid[head]] for head in range(2)]
        for name in ("keys", "values", "scores", "seen", "last_probs", "token_index", "rank")
    }
    store.compact()
    assert store.active == store.length == 5
    assert store.valid[:, :5].all() and not store.valid[:, 5:].any()
    for name, kept in before.items():
        for head in range(2):
            assert torch.equal(getattr(store, name)[head, :5], kept[head]), name  # slot order kept


def test_decode_after_chunks_reads_only_the_entries():
    """After a prefill chunk the decode step compacts once: it then attends `budget + 1` slots, not the
    `budget + chunk` the chunk used (and still matches the naive simulation, above)."""
    torch.manual_seed(2)
    rope_tables, _ = make_rope()
    settings = CacheSettings(budget=8, chunk=9).resolved(256)
    store = LayerStore(N_KV, HEAD_DIM, 8, 9, torch.float32, torch.device("cpu"))
    layer = H2OLayer(store, settings, rope_tables, 256)
    start = 0
    for chunk in [9, 9, 1, 1]:
        q, k, v = (
            torch.randn(N_HEADS, chunk, HEAD_DIM),
            torch.randn(N_KV, chunk, HEAD_DIM),
            torch.randn(N_KV, chunk, HEAD_DIM),
        )
        feed_chunk(layer, q, k, v, start)
        start += chunk
        if start == 18:  # the second chunk filled slots up to 16, then evicted 9 of the 17 entries
            assert store.active == 17 and store.length == 8
    assert store.active == 9 and store.length == 8


def test_restored_snapshot_decodes_as_before(tiny_pair):
    """The eval scorer puts a prefilled state back before each continuation; a decode step in between packed
    the entries below a smaller `active`, so the restore must widen it again (else entries are lost)."""
    from h2o_cli.cache import H2OCache

    _, model = tiny_pair
    torch.manual_seed(0)
    cache = H2OCache(model, CacheSettings(budget=8, chunk=16))
    ids = torch.randint(0, 128, (1, 40))

    def decode(tokens):
        return [model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in tokens]

    with torch.inference_mode():
        for start in range(0, 32, 16):
            model(input_ids=ids[:, start : start + 16], cache=cache, use_cache=True)
        state = cache.state()
        first = decode(range(32, 40))
        assert cache.stores[0].active == 9  # packed by the first step
        cache.restore(state)
        again = decode(range(32, 40))
    for one, two in zip(first, again, strict=True):
        torch.testing.assert_close(one, two)
