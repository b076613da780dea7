"""Recall past the model's context window: rolling positions keep every position inside the
window while the archive brings back tokens read several windows earlier, exactly as docs/spec.md says."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import SHARED_DATA, tiny_config
from naive import naive_model_nll
from transformers import LlamaForCausalLM

from h2o_cli.cache import H2OCache
from h2o_cli.cache.positions import Rope
from h2o_cli.config import CacheSettings
from h2o_cli.streaming import forward_chunk

WINDOW = 64  # the tiny model's max_position_embeddings
# fp32 forward vs the naive float64 softmax (tests/test_reference.py measured <= 3.4e-5 nats per token).
NLL_TOLERANCE = 2e-4


def test_recall_past_a_tiny_models_window_equals_the_naive_simulation(monkeypatch):
    """A 64-position model reads 320 tokens (5 windows) with `recall` on rolling positions: every position it
    is given stays below budget + chunk, tokens of the first window are recalled in the last windows, and each
    next-token NLL equals the naive simulation's (tests/naive.py: recall without an archive cap)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(max_position_embeddings=WINDOW)).eval()
    settings = CacheSettings(
        budget=16, policy="recall", chunk=8, page_size=4, archive_max=512, positions="rolling"
    )
    lengths: list[int] = []
    table = Rope.table
    monkeypatch.setattr(
        Rope, "table", lambda self, length, *a: lengths.append(length) or table(self, length, *a)
    )
    cache = H2OCache(model, settings)
    ids = torch.randint(0, 128, (320,), generator=torch.Generator().manual_seed(1)).tolist()
    logprobs, early_recalls = [], 0
    with torch.no_grad():
        for start in range(0, len(ids), 8):
            logprobs.append(
                torch.log_softmax(forward_chunk(model, cache, ids[start : start + 8]).double(), -1)
            )
            if start >= 4 * WINDOW:  # the fifth window: recalled tokens read four windows earlier
                early_recalls += sum(
                    int(((layer.recall_index >= 0) & (layer.recall_index < WINDOW)).sum())
                    for layer in cache.layers
                )
    logprobs = torch.cat(logprobs)
    ours = [-float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    want = naive_model_nll(model, ids, settings, chunk=8)
    assert early_recalls > 0, "no token of the first window was recalled in the fifth"
    assert max(lengths) <= 16 + 8 < WINDOW  # rolling: E_q ranks, never the token index
    assert cache.archive_summary().archive_oldest == 0
    assert len(ours) == len(want) == 319
    for position, (got, expected) in enumerate(zip(ours, want, strict=True)):
        assert abs(got - expected) <= NLL_TOLERANCE, f"prediction {position}: {got} vs {expected}"


@pytest.mark.parametrize("kernels", ["torch", "auto"])  # auto: the C steps where a compiler is found
def test_recall_in_named_layers_equals_the_naive_simulation(kernels):
    """`--recall-layers 1`: layer 1 recalls, layer 0 holds S alone (`h2o` on the resident budget, no
    archive), past the window on rolling positions, through chunks and one-token steps; each NLL equals the
    naive simulation's with that per-layer contract, and not the one where both layers recall."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(max_position_embeddings=WINDOW)).eval()
    settings = CacheSettings(
        budget=16,
        policy="recall",
        chunk=8,
        page_size=4,
        archive_max=512,
        recall_layers="1",
        kernels=kernels,
        recall_ratio=0.5,
    )
    cache = H2OCache(model, settings)
    assert cache.layers[0].archive is None and cache.layers[0].store.budget == 8
    assert cache.layers[1].archive.capacity == 512 and cache.layers[1].store.budget == 8
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    sizes = [8] * 20 + [1] * 40
    logprobs, start = [], 0
    with torch.no_grad():
        for size in sizes:
            logprobs.append(
                torch.log_softmax(forward_chunk(model, cache, ids[start : start + size]).double(), -1)
            )
            start += size
    logprobs = torch.cat(logprobs)
    ours = [-float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    want = naive_model_nll(model, ids, settings, sizes=sizes)
    both = naive_model_nll(model, ids, dataclasses.replace(settings, recall_layers="all"), sizes=sizes)
    assert cache.layers[1].recalled_total > 0
    assert max(abs(a - b) for a, b in zip(want, both, strict=True)) > 100 * NLL_TOLERANCE
    for position, (got, expected) in enumerate(zip(ours, want, strict=True)):
        assert abs(got - expected) <= NLL_TOLERANCE, f"prediction {position}: {got} vs {expected}"
    summary, recalled = cache.archive_summary(), cache.layer_slots()[0].recalled
    assert summary.archive_bytes == cache.layers[1].archive.nbytes()
    assert recalled.shape == cache.layers[1].recall_index.shape and bool((recalled == -1).all())


MODEL_WINDOW = 8192  # SmolLM2-135M's max_position_embeddings
LAST = 16  # tokens of the last call, recomputed by hand
PAGE = 32


def reference_last_call(model, ids, resident, recalled, keys, values):
    """Logits [len(ids), vocab] of the last call, recomputed outside the cache: per layer and KV head each
    query attends over E_q = resident ∪ recalled ∪ {call tokens <= q} (docs/spec.md) with rolling positions
    (ranks in E_q), K/V of earlier tokens as the model projected them (captured), float64 attention and
    tests/naive.py's RoPE. Also returns each layer's unrotated queries [n_kv, group * len(ids), head_dim]."""
    from naive import inv_freq_of, rope

    config = model.config
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // n_heads
    group, count = n_heads // n_kv, len(ids)
    inv_freq, scaling = inv_freq_of(config, head_dim), head_dim**-0.5
    hidden = model.model.embed_tokens(torch.tensor(ids))
    queries = []
    for number, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(count, n_heads, head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(count, n_kv, head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(count, n_kv, head_dim).transpose(0, 1)
        queries.append(q.reshape(n_kv, group * count, head_dim))
        out = torch.zeros(n_heads, count, head_dim, dtype=torch.float64)
        for head in range(n_kv):
            old = sorted(set(resident[number][head]) | set(recalled[number][head]))
            for i in range(count):
                k_seen = torch.cat([keys[number, head, old], k[head, : i + 1]]).double()
                v_seen = torch.cat([values[number, head, old], v[head, : i + 1]]).double()
                rotated = rope(k_seen, torch.arange(len(k_seen)), inv_freq)
                heads = slice(head * group, (head + 1) * group)
                q_rot = rope(q[heads, i : i + 1], torch.tensor([len(k_seen) - 1]), inv_freq)[:, 0]
                out[heads, i] = torch.softmax(q_rot @ rotated.T * scaling, dim=-1) @ v_seen
        hidden = hidden + attn.o_proj(out.float().transpose(0, 1).reshape(count, n_heads * head_dim))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.model.norm(hidden)), queries


@pytest.mark.data
@pytest.mark.slow
def test_recall_past_the_embedded_models_window(smollm):
    """SmolLM2-135M reads 8,464 tokens of a book (its window is 8,192) with `recall` on rolling positions.
    In the last call (16 tokens at 8,448..) some KV heads attend tokens more than 8,192 tokens back, brought
    back from the archive; that call's logits equal a recomputation over exactly the E_q the cache attended,
    and each head recalled the tokens the naive simulation's page order (tests/naive.py `naive_recall`: the
    attention score, ties to the older page, oldest first inside a page) picks from the captured keys."""
    model, tokenizer = smollm
    text = (SHARED_DATA / "gutenberg_books" / "moby_dick_pg2701.txt").read_text(encoding="utf-8")
    ids = tokenizer(text[:60_000])["input_ids"]
    total = MODEL_WINDOW + 256 + LAST
    assert len(ids) >= total
    ids = ids[:total]
    first = total - LAST
    # |S| = r = 64; pages of 32 keep pass 1 cheap (its cost grows with the archive's pages), the archive holds it all.
    # Each head ranks its own pages (no lead head: its ranking is tests/test_recall_lead.py's).
    settings = CacheSettings(
        budget=128, policy="recall", chunk=256, page_size=PAGE, archive_max=total, positions="rolling",
        recall_lead="none",
    )  # fmt: skip
    cache = H2OCache(model, settings)
    config = model.config
    n_kv, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    layers = model.model.layers
    keys = torch.empty(len(layers), n_kv, total, head_dim)
    values = torch.empty_like(keys)
    offset = [0]

    def capture(buffer, number):
        def hook(module, inputs, output):
            count = output.shape[1]
            buffer[number, :, offset[0] : offset[0] + count] = (
                output[0].view(count, n_kv, head_dim).transpose(0, 1)
            )

        return hook

    handles = [
        layer.self_attn.k_proj.register_forward_hook(capture(keys, n)) for n, layer in enumerate(layers)
    ]
    handles += [
        layer.self_attn.v_proj.register_forward_hook(capture(values, n)) for n, layer in enumerate(layers)
    ]
    nll, predictions = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, first, 256):
                offset[0] = start
                logits = forward_chunk(model, cache, ids[start : start + 256])
                targets = torch.tensor(ids[start + 1 : start + 257])
                logprobs = torch.log_softmax(logits[: len(targets)].double(), -1)
                nll -= float(logprobs.gather(1, targets[:, None]).sum())
                predictions += len(targets)
            resident = [
                [store.token_index[head][store.valid[head]].tolist() for head in range(n_kv)]
                for store in cache.stores
            ]
            offset[0] = first
            got = forward_chunk(model, cache, ids[first:])
            recalled = [
                [[t for t in layer.recall_index[head].tolist() if t >= 0] for head in range(n_kv)]
                for layer in cache.layers
            ]
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        want, queries = reference_last_call(model, ids[first:], resident, recalled, keys, values)
    assert cache.tokens_seen == total and cache.archive_summary().archive_oldest == 0
    # A book read far better than chance (uniform over the vocabulary: log(vocab) nats per token).
    assert math.isfinite(nll / predictions) and nll / predictions < math.log(config.vocab_size) / 2
    far = [t for layer in recalled for head in layer for t in head if first - t > MODEL_WINDOW]
    assert far, "no KV head recalled a token more than the model's window back"
    torch.testing.assert_close(got, want.float(), rtol=1e-3, atol=1e-3)
    # Pass 1 by docs/spec.md: every archived key (the call's too) and S of each head as captured, the call's
    # unrotated queries; the page order of the naive simulation picks R.
    from naive import NaiveHeadState, inv_freq_of, naive_recall

    inv_freq = inv_freq_of(config, head_dim)
    for number in range(len(layers)):
        for head in range(n_kv):
            state = NaiveHeadState()
            state.keys = list(keys[number, head])
            state.alive = [False] * total
            for t in [*resident[number][head], *range(first, total)]:
                state.alive[t] = True
            want_recalled = naive_recall(state, queries[number][head], first, LAST, settings, inv_freq)
            chosen = recalled[number][head]
            assert len(chosen) == 64 and sorted(chosen) == sorted(want_recalled), (number, head)
