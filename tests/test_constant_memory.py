"""Streams past the context window with rolling positions, in buffers that never move or grow."""

from __future__ import annotations

import pytest
import torch
from naive import naive_model_nll

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.streaming import stream_perplexity


def buffer_layout(cache: H2OCache) -> list[tuple[int, tuple[int, ...]]]:
    return [
        (getattr(store, name).data_ptr(), tuple(getattr(store, name).shape))
        for store in cache.stores
        for name in store._state_names()
    ]


def stream_and_watch(model, cache, ids, chunk):
    """`stream_perplexity` of `ids` in chunks of `chunk`: (its stats, the buffers' layout after each chunk,
    each chunk's NLL: its tokens' predictions, the first from the chunk before)."""
    layouts, running = [], [0.0]

    def watch(stats) -> None:
        layouts.append(buffer_layout(cache))
        running.append(stats.nll)

    stats = stream_perplexity(model, cache, [ids], chunk, on_chunk=watch)
    return stats, layouts, [after - before for before, after in zip(running, running[1:], strict=False)]


def per_chunk(nll: list[float], chunk: int) -> list[float]:
    """Per-prediction NLLs (the first predicts token 1) summed as `stream_and_watch` reports them per chunk."""
    return [sum(nll[: chunk - 1])] + [
        sum(nll[start - 1 : start - 1 + chunk]) for start in range(chunk, len(nll) + 1, chunk)
    ]


@pytest.fixture
def short_window():
    """The tiny random-weight Llama with a 64-token window: streams several windows long in a few hundred
    tokens (budget 32 + chunk 16 still fit the window under rolling positions)."""
    from conftest import tiny_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(max_position_embeddings=64)).eval()


@pytest.mark.parametrize("policy", ["h2o", "local", "sink", "tova"])
@pytest.mark.parametrize("chunk", [1, 16])
def test_tiny_model_streams_6x_its_window_in_fixed_buffers_as_the_naive_simulation(
    short_window, policy, chunk
):
    """Six windows of tokens through 32 slots on rolling positions: the buffers never move or grow, and every
    chunk's NLL equals the naive SPEC.md simulation's."""
    model = short_window
    window = model.config.max_position_embeddings
    ids = torch.randint(
        0, model.config.vocab_size, (6 * window,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    settings = CacheSettings(budget=32, policy=policy, chunk=chunk)
    cache = H2OCache(model, settings)
    before = buffer_layout(cache)
    stats, layouts, ours = stream_and_watch(model, cache, ids, chunk)
    assert stats.error is None and stats.tokens == len(ids) and stats.predictions == len(ids) - 1
    assert all(layout == before for layout in layouts)
    assert cache.length == 32 and cache.tokens_seen == len(ids)
    want = per_chunk(naive_model_nll(model, ids, settings, chunk=chunk), chunk)  # one entry per prediction
    assert len(ours) == len(want) == -(-len(ids) // chunk)
    assert ours == pytest.approx(want, abs=1e-4)  # float32 sums of up to 16 NLLs of ~5 nats


def test_original_positions_stop_at_the_window_and_keep_the_partial_result(tiny_pair):
    _, model = tiny_pair
    window = model.config.max_position_embeddings
    ids = list(range(10, 10 + 100)) * 4
    cache = H2OCache(model, CacheSettings(budget=32, positions="original", chunk=50))
    stats = stream_perplexity(model, cache, [ids], 50)
    assert stats.error is not None and "context window" in stats.error
    assert stats.tokens == window - window % 50 and stats.predictions == stats.tokens - 1


def local_window_nll(plain, ids: list[int], window: int) -> list[float]:
    """NLL of each next token by plain transformers when each chunk of `window` tokens attends the `window`
    tokens before it and itself, causally: a `DynamicCache` whose oldest entries are dropped after each chunk,
    every key rotated at its own position (RoPE is relative: rolling ranks give the same logits). What `local`
    with budget = chunk = `window` attends."""
    from transformers import DynamicCache

    cache, nll = DynamicCache(), []
    with torch.no_grad():
        for start in range(0, len(ids), window):
            piece = ids[start : start + window]
            positions = torch.arange(start, start + len(piece))[None]
            logits = plain(torch.tensor([piece]), cache=cache, position_ids=positions).logits[0]
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, -window:], layer.values[:, :, -window:]
            targets = torch.tensor(ids[start + 1 : start + window + 1])
            logprobs = torch.log_softmax(logits[: len(targets)].float(), -1)
            nll += (-logprobs.gather(1, targets[:, None])[:, 0]).tolist()
    return nll


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["h2o", "local"])
def test_embedded_model_streams_past_8192_in_fixed_buffers(smollm, plain_smollm, excerpt, policy):
    """9,000 tokens, past the model's 8,192-token window, in buffers that never move or grow. Under `local`,
    each chunk's NLL is plain transformers' over the chunk and the 256 tokens before it (`local_window_nll`),
    to float rounding (tests/test_reference.py's per-token tolerance); `h2o`'s values past the window are the
    naive simulation's on the tiny model above."""
    from test_reference import NLL_TOLERANCE

    model, tokenizer = smollm
    ids = (tokenizer(excerpt)["input_ids"] * 12)[:9000]
    cache = H2OCache(model, CacheSettings(budget=256, chunk=256, policy=policy))
    before = buffer_layout(cache)
    stats, layouts, ours = stream_and_watch(model, cache, ids, 256)
    assert stats.error is None and stats.tokens == 9000 > model.config.max_position_embeddings
    assert all(layout == before for layout in layouts)
    if policy == "local":
        want = per_chunk(local_window_nll(plain_smollm, ids, 256), 256)
        assert len(ours) == len(want) and ours == pytest.approx(want, abs=256 * NLL_TOLERANCE)


@pytest.mark.parametrize("policy", ["h2o", "local", "sink", "tova"])
def test_one_call_longer_than_the_spare_is_split_inside_the_cache(tiny_pair, policy):
    """Regression: one 100-token call with 8 spare slots grew the buffers for good. Now the cache splits it
    into sub-chunks that fit its free slots; SPEC allows any chunking, so the result must equal the naive
    reference run with those chunks: 40 (32 budget + 8 spare, empty cache), then 8 at a time."""
    from naive import naive_model_nll

    _, model = tiny_pair
    ids = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    settings = CacheSettings(budget=32, policy=policy, chunk=8)
    cache = H2OCache(model, settings)
    before = buffer_layout(cache)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0]
    assert buffer_layout(cache) == before
    assert cache.length == 32 and cache.tokens_seen == 100
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    got = [-float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    want = naive_model_nll(model, ids, settings, sizes=[40] + [8] * 7 + [4])
    assert got == pytest.approx(want, abs=2e-4)


def test_generate_with_a_long_prompt_keeps_the_buffers(tiny_pair):
    """README's example: `model.generate(..., past_key_values=H2OCache(...))` with a prompt longer than the
    spare slots."""
    _, model = tiny_pair
    prompt = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(3))
    cache = H2OCache(model, CacheSettings(budget=32, chunk=8))
    before = buffer_layout(cache)
    output = model.generate(prompt, cache=cache, max_new_tokens=6, do_sample=False)
    assert output.shape[1] == 106 and buffer_layout(cache) == before and cache.length == 32
