"""A bf16 read's softmax in C (`h2o_kernels.native_read`, the `C_READ` path) against the torch reference: the
masked softmax of the same bf16 logits, `reference.slot_attention`, and an h2o and a recall cache read both ways."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from h2o_kernels import native, native_read
from h2o_kernels.reference import hiding, later_in_chunk, rotate, slot_attention

from h2o_cli.cache.paths import C_READ, CHUNK
from h2o_cli.config import CacheSettings

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


def torch_softmax(logits, leading, weights):
    """The reference's steps between its two matmuls, on the same bf16 logits [n_kv, group, chunk, slots]."""
    n_kv, group, chunk, slots = logits.shape
    masked = logits.clone()
    masked[..., slots - chunk :].add_(later_in_chunk(chunk, masked.dtype, masked.device))
    if leading is not None:
        masked[..., : leading.shape[1]].add_(hiding(leading, masked.dtype)[:, None, None, :])
    probs = torch.softmax(masked, dim=-1, dtype=torch.float32)
    flat = probs.view(n_kv, group * chunk, slots)
    increments = flat.sum(dim=1) if weights is None else torch.einsum("kgcs,c->ks", probs, weights)
    return flat.to(torch.bfloat16), increments, probs[:, :, -1].sum(dim=1)


@needs_compiler
@pytest.mark.parametrize("leading", [False, True], ids=["no-empty-slots", "empty-recall-slots"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "decayed"])
def test_the_c_softmax_is_the_torch_one(leading, weighted):
    """Probabilities in bf16 equal but for rare one-ulp rounding ties; the float32 sums within a few ulp; masked
    entries (later tokens of the chunk, empty recall slots) exactly 0."""
    generator = torch.Generator().manual_seed(2 * leading + weighted)
    n_kv, group, chunk, slots = 3, 3, 48, 130
    logits = (torch.randn(n_kv, group, chunk, slots, generator=generator) * 4).bfloat16()
    present = torch.rand(n_kv, 40, generator=generator) > 0.3 if leading else None
    weights = 0.9 ** torch.arange(chunk - 1, -1, -1, dtype=torch.float32) if weighted else None
    got = native_read.read_softmax(logits, present, weights)
    want = torch_softmax(logits, present, weights)
    probs, increments, last = got
    assert probs.dtype == torch.bfloat16 and probs.shape == want[0].shape
    assert (probs != want[0]).float().mean() < 1e-3
    torch.testing.assert_close(probs.float(), want[0].float(), rtol=2**-7, atol=1e-7)
    assert torch.equal(probs == 0, want[0] == 0), "the masked entries, and only they, are 0"
    torch.testing.assert_close(increments, want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(last, want[2], rtol=1e-5, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("table", ["shared", "per-row", "expanded"])
def test_the_c_rotation_to_bf16_is_the_torch_one_bit_for_bit(table):
    """`rotate_to_bf16` against `reference.rotate`, scaled, then `.to(torch.bfloat16)`: the same bits, whether
    the rows share one table (a chunk's queries over their heads), have one each (keys), or an expanded one."""
    torch.manual_seed(5)
    n, rows, head_dim = 3, 37, 64
    x = torch.randn(n, rows, head_dim) * 3
    angles = torch.rand(rows, head_dim // 2).repeat(1, 2) * 50
    # Row 0 turns by 0 and holds exact halfway cases of bf16 (1 + odd/256): rounding ties, to even.
    angles[0] = 0
    x[:, 0] = 1 + (2 * torch.arange(head_dim) + 1) / 256
    cos, sin = angles.cos(), angles.sin()
    if table == "per-row":
        cos, sin = (
            torch.stack([cos.roll(i, 0) for i in range(n)]),
            torch.stack([sin.roll(i, 0) for i in range(n)]),
        )
    elif table == "expanded":
        cos, sin = cos.expand(n, -1, -1), sin.expand(n, -1, -1)
    for scale in (1.0, 0.125, 0.0625**0.5 / 3):
        want = (rotate(x, cos, sin) * scale).to(torch.bfloat16)
        assert torch.equal(native_read.rotate_to_bf16(x, cos, sin, scale), want), scale


@needs_compiler
@pytest.mark.parametrize("group", [1, 3, 4])
def test_native_read_attention_is_the_reference(group):
    """`native_read.slot_attention` of a bf16 read in token order against `reference.slot_attention`, the same
    inputs: outputs within bf16's rounding, score sums within float32's; a call it does not serve (a mask over
    the slots, a float32 call) is the reference's bit for bit."""
    torch.manual_seed(group)
    n_kv, chunk, slots, head_dim = 2, 32, 90, 16
    query = torch.randn(n_kv * group, chunk, head_dim)
    keys, values = torch.randn(n_kv, slots, head_dim), torch.randn(n_kv, slots, head_dim)
    angles = torch.rand(slots, head_dim // 2).repeat(1, 2) * 6
    cos, sin = angles.cos(), angles.sin()
    key_cos, key_sin = cos.expand(n_kv, -1, -1), sin.expand(n_kv, -1, -1)
    args = (query, keys, values, None, cos[-chunk:], sin[-chunk:], key_cos, key_sin, head_dim**-0.5, None)
    want = slot_attention(*args, torch.bfloat16)
    got = native_read.slot_attention(*args, torch.bfloat16)
    torch.testing.assert_close(got[0], want[0], rtol=0.02, atol=0.02)
    for mine, theirs in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    allowed = torch.rand(n_kv, chunk, slots) > 0.2
    for served_by_reference in ((*args[:3], allowed, *args[4:], torch.bfloat16), (*args, None)):
        for mine, theirs in zip(
            native_read.slot_attention(*served_by_reference),
            slot_attention(*served_by_reference),
            strict=True,
        ):
            assert torch.equal(mine, theirs)


@needs_compiler
@pytest.mark.parametrize("policy", ["h2o", "recall"])
def test_a_bf16_read_takes_the_c_softmax_and_keeps_what_the_torch_one_keeps(monkeypatch, policy):
    """Two caches told to read in bf16 (as `--dtype auto` sets them), one under `--kernels torch`: reads take
    `C_READ` under `auto` and `CHUNK` under `torch`, with logits within bf16's rounding of each other and the
    same tokens kept and recalled (the C sums differ from torch's in the last float32 bits only)."""
    from transformers import LlamaForCausalLM

    from h2o_cli.cache import H2OCache
    from h2o_cli.cache import paths as chosen
    from h2o_cli.streaming import forward_chunk

    torch.manual_seed(4)
    model = LlamaForCausalLM(tiny_config()).eval()
    caches = {}
    for kernels in ("auto", "torch"):
        settings = CacheSettings(budget=48, policy=policy, chunk=32, kernels=kernels)
        caches[kernels] = H2OCache(model, settings)
        for layer in caches[kernels].layers:
            layer.read_matmul, layer.read_rows = torch.bfloat16, 16
    taken = []
    choose = chosen.choose_path

    def spy(layer, states):
        path = choose(layer, states)
        taken.append((layer in caches["auto"].layers, states.shape[2], path))
        return path

    monkeypatch.setattr("h2o_cli.cache.layer.choose_path", spy)
    ids = torch.randint(0, 128, (300,)).tolist()
    start = 0
    for size in (32, 32, 32, 1, 1, 32, 20, 3, 32, 32, 32):
        piece = ids[start : start + size]
        with torch.no_grad():
            got, want = (
                forward_chunk(model, caches["auto"], piece),
                forward_chunk(model, caches["torch"], piece),
            )
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
        start += size
    reads = {(auto, path) for auto, rows, path in taken if rows >= 16}
    assert reads == {(True, C_READ), (False, CHUNK)}
    for mine, theirs in zip(caches["auto"].layers, caches["torch"].layers, strict=True):
        assert torch.equal(mine.store.token_index, theirs.store.token_index)
        if policy == "recall":
            assert torch.equal(mine.recall_index, theirs.recall_index)
    if policy == "recall":
        assert caches["auto"].archive_summary().recalled_per_step > 0
