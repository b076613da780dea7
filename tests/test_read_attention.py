"""A read's attention on the chunk path: S gathered in token order (one [chunk, chunk] mask) against the mask
over every slot, and a read's QK^T and PV in bf16 (`--dtype auto`) against the attention of bf16 operands."""

from __future__ import annotations

import pytest
import torch
from conftest import feed_chunk, tiny_config
from h2o_kernels.reference import slot_attention
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from h2o_cli.cache import H2OLayer
from h2o_cli.cache.paths.chunk import ChunkPath
from h2o_cli.cache.positions import Rope
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings

N_HEADS, N_KV, HEAD_DIM = 6, 2, 16
CHUNKS = [5, 1, 7, 3, 1, 1, 9, 2, 4, 1, 6, 9, 9]  # sub-chunks after evictions leave holes below `active`


def make_layer(settings: CacheSettings, dtype=torch.float64) -> H2OLayer:
    config = tiny_config(
        hidden_size=N_HEADS * HEAD_DIM, num_attention_heads=N_HEADS, num_key_value_heads=N_KV
    )
    store = LayerStore(N_KV, HEAD_DIM, settings.budget, settings.chunk, dtype, torch.device("cpu"))
    rope = Rope(LlamaRotaryEmbedding(config), HEAD_DIM)
    return H2OLayer(store, settings, rope, config.max_position_embeddings)


def random_chunk(size: int, dtype=torch.float64):
    q = torch.randn(N_HEADS, size, HEAD_DIM, dtype=dtype) * 2
    k = torch.randn(N_KV, size, HEAD_DIM, dtype=dtype) * 2
    return q, k, torch.randn(N_KV, size, HEAD_DIM, dtype=dtype)


@pytest.mark.parametrize(
    "overrides",
    [dict(positions="rolling"), dict(positions="original"), dict(positions="rolling", score_decay=0.7)],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
def test_token_order_is_the_mask_over_every_slot(monkeypatch, overrides):
    """Two layers fed the same chunks, one on the chunk path's layout (S in token order), one with E_q as a
    mask over every slot (`ChunkPath.in_order` off): the same outputs, entries, ranks and scores."""
    torch.manual_seed(3)
    settings = CacheSettings(budget=8, chunk=9, **overrides)
    ordered, masked = make_layer(settings), make_layer(settings)
    start = 0
    for size in CHUNKS:
        q, k, v = random_chunk(size)
        want_in_order = feed_chunk(ordered, q, k, v, start)
        monkeypatch.setattr(ChunkPath, "in_order", False)
        want_masked = feed_chunk(masked, q, k, v, start)
        monkeypatch.setattr(ChunkPath, "in_order", True)
        # A float64 store's softmax runs in float32 (`slot_attention`), summed here in another order.
        torch.testing.assert_close(want_in_order, want_masked, rtol=1e-5, atol=1e-5)
        for name in ("valid", "token_index", "rank"):
            assert torch.equal(getattr(ordered.store, name), getattr(masked.store, name)), (name, start)
        for name in ("scores", "seen", "last_probs"):
            got, want = getattr(ordered.store, name), getattr(masked.store, name)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        start += size


def attention_inputs(chunk: int, slots: int, dtype=torch.float32):
    """Keys in token order ending with the chunk's own, and the explicit E_q of each query (every key up to
    its own token)."""
    q = torch.randn(N_HEADS, chunk, HEAD_DIM, dtype=dtype) * 2
    keys = torch.randn(N_KV, slots, HEAD_DIM, dtype=dtype) * 2
    values = torch.randn(N_KV, slots, HEAD_DIM, dtype=dtype)
    tokens = torch.arange(slots)
    allowed = (tokens.view(1, 1, -1) <= (slots - chunk + torch.arange(chunk)).view(1, -1, 1)).expand(
        N_KV, -1, -1
    )
    cos, sin = torch.ones(slots, HEAD_DIM, dtype=dtype), torch.zeros(slots, HEAD_DIM, dtype=dtype)  # no turn
    return (
        q,
        keys,
        values,
        allowed,
        cos[-chunk:],
        sin[-chunk:],
        cos.expand(N_KV, -1, -1),
        sin.expand(N_KV, -1, -1),
    )


def test_the_corner_mask_is_the_full_mask_bit_for_bit():
    """`slot_attention` with `allowed` None (keys in token order, the chunk's own last) is the explicit mask's
    attention exactly: the same columns in the same order, the masked ones at -inf either way."""
    torch.manual_seed(4)
    q, keys, values, allowed, *tables = attention_inputs(16, 40)
    explicit = slot_attention(q, keys, values, allowed, *tables, HEAD_DIM**-0.5)
    corner = slot_attention(q, keys, values, None, *tables, HEAD_DIM**-0.5)
    for got, want in zip(corner, explicit, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("scaling", [0.25, 0.3])  # a power of two, and not
def test_bf16_matmuls_are_the_attention_of_bf16_operands(scaling):
    """QK^T and PV in bf16: the output is the float64 attention of the bf16-rounded scaled query, keys,
    probabilities and values, each product rounded to bf16 as a bf16 matmul's is, and much closer to it than
    the fp32 attention is; the score increments are float32 probabilities, each query's summing to one."""
    torch.manual_seed(5)
    chunk, slots, group = 32, 80, N_HEADS // N_KV
    q, keys, values, allowed, *tables = attention_inputs(chunk, slots)
    output, increments, last = slot_attention(
        q, keys, values, allowed, *tables, scaling, None, torch.bfloat16
    )
    fp32_output = slot_attention(q, keys, values, allowed, *tables, scaling)[0]
    assert output.dtype == increments.dtype == last.dtype == torch.float32

    def bf16(x):
        return x.to(torch.bfloat16).double()

    grouped = bf16(q * scaling).view(N_KV, group * chunk, HEAD_DIM)
    logits = bf16(grouped @ bf16(keys).transpose(1, 2)).view(N_KV, group, chunk, slots)  # a bf16 matmul's
    probs = logits.masked_fill(~allowed.unsqueeze(1), float("-inf")).softmax(-1)
    want = bf16(bf16(probs.view(N_KV, group * chunk, slots)) @ bf16(values)).view(N_HEADS, chunk, HEAD_DIM)
    error, fp32_error = (output.double() - want).abs().max(), (fp32_output.double() - want).abs().max()
    assert error < 0.02 and error < fp32_error / 2, (error, fp32_error)
    torch.testing.assert_close(
        increments.sum(dim=1).double(), torch.full((N_KV,), group * chunk * 1.0, dtype=torch.float64)
    )
    torch.testing.assert_close(increments.double(), probs.sum(dim=(1, 2)), rtol=0.05, atol=0.02)


def test_only_a_read_multiplies_in_bf16():
    """A float32 layer told to read in bf16 (`read_matmul`, as `build_layers` sets it under `--dtype auto`):
    calls below `read_rows` tokens are the float32 layer's bit for bit, a read of `read_rows` or more differs
    by bf16's rounding only."""
    torch.manual_seed(6)
    settings = CacheSettings(budget=24, chunk=32)
    fp32, auto = make_layer(settings, torch.float32), make_layer(settings, torch.float32)
    auto.read_matmul, auto.read_rows = torch.bfloat16, 16
    start = 0
    for size in (15, 1, 3, 16, 32, 1):
        q, k, v = random_chunk(size, torch.float32)
        want, got = feed_chunk(fp32, q, k, v, start), feed_chunk(auto, q, k, v, start)
        if size < 16:
            assert torch.equal(got, want), size
            assert torch.equal(auto.store.scores, fp32.store.scores), size
        else:
            assert not torch.equal(got, want), size
            torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
        start += size
        if size >= 16:  # the scores differ by bf16's rounding: go on from the same store
            auto.store.restore(fp32.store.state())


def test_a_recall_read_multiplies_in_bf16_over_s_and_r(monkeypatch):
    """Under `--dtype auto` a recall layer's read of `read_rows` tokens or more multiplies QK^T and PV over S ∪ R
    in bf16, as an h2o layer's does over S, and its smaller calls in float32; the logits stay within bf16's
    rounding of the float32 cache's."""
    from transformers import LlamaForCausalLM

    from h2o_cli.cache import H2OCache
    from h2o_cli.streaming import forward_chunk

    torch.manual_seed(3)
    model = LlamaForCausalLM(tiny_config()).eval()
    settings = CacheSettings(budget=32, policy="recall", chunk=16)
    fp32, auto = H2OCache(model, settings), H2OCache(model, settings)
    for layer in auto.layers:
        layer.read_matmul, layer.read_rows = torch.bfloat16, 16
    calls = []  # (call rows, R among the keys, matmul dtype) of the auto cache's attention calls
    slot_attention_of = ChunkPath.slot_attention

    def spy(self, layer, query, keys, values, allowed, positions, first, scaling, matmul, *rest):
        if any(layer is ours for ours in auto.layers):
            calls.append((query.shape[1], keys.shape[1] > layer.store.length, matmul))
        return slot_attention_of(
            self, layer, query, keys, values, allowed, positions, first, scaling, matmul, *rest
        )

    monkeypatch.setattr(ChunkPath, "slot_attention", spy)
    ids = torch.randint(0, 128, (200,)).tolist()
    start = 0
    for size in (16, 16, 16, 16, 1, 1, 32, 16, 3, 1, 16, 16, 32):
        piece = ids[start : start + size]
        with torch.no_grad():
            want, got = forward_chunk(model, fp32, piece), forward_chunk(model, auto, piece)
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
        start += size
    assert auto.archive_summary().recalled_per_step > 0
    recalling = [(rows, matmul) for rows, with_r, matmul in calls if with_r]
    assert {rows >= 16 for rows, _ in recalling} == {True, False}, "reads and steps both attend R"
    assert all(matmul == (torch.bfloat16 if rows >= 16 else None) for rows, matmul in recalling)


@pytest.mark.parametrize("positions", ["rolling", "original"])
def test_a_recall_read_in_token_order_is_the_mask_over_s_and_r(monkeypatch, positions):
    """A recall cache reads R first, then S in token order, masking only the chunk's corner and R's empty
    slots: the same logits, entries, scores and recalled tokens as E_q as a mask over S ∪ R."""
    from transformers import LlamaForCausalLM

    from h2o_cli.cache import H2OCache
    from h2o_cli.streaming import forward_chunk

    torch.manual_seed(4)
    model = LlamaForCausalLM(tiny_config()).eval()
    settings = CacheSettings(budget=32, policy="recall", chunk=16, positions=positions)
    ordered, masked = H2OCache(model, settings), H2OCache(model, settings)
    ids = torch.randint(0, 128, (240,)).tolist()
    start = 0
    for size in (16, 16, 7, 16, 1, 1, 32, 16, 3, 1, 16, 16, 32, 16, 16, 1, 16):
        piece = ids[start : start + size]
        with torch.no_grad():
            want = forward_chunk(model, ordered, piece)
            monkeypatch.setattr(ChunkPath, "in_order", False)
            got = forward_chunk(model, masked, piece)
            monkeypatch.setattr(ChunkPath, "in_order", True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for ours, theirs in zip(ordered.layers, masked.layers, strict=True):
            assert torch.equal(ours.recall_index, theirs.recall_index), start
            assert torch.equal(ours.store.token_index, theirs.store.token_index), start
            torch.testing.assert_close(ours.store.scores, theirs.store.scores, rtol=1e-5, atol=1e-5)
        start += size
    summary = ordered.archive_summary()
    assert summary.recalled_per_step > 0
