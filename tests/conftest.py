"""Shared fixtures: a tiny random-weight Llama (GQA) for unit tests, the embedded model for end-to-end ones."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

# Two busy processes on two cores make spinning OpenMP threads ~25x slower (ENV-NOTES.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton reads this once, when first imported (transformers or bitsandbytes may import it during collection).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
# The library finds data only through --data-dir or $H2O_DATA; the tests use the project's copy by default.
SHARED_DATA = Path(os.environ.get("H2O_DATA") or REPO.parent / "shared" / "data")
FIXTURES = Path(__file__).resolve().parent / "data"
if SHARED_DATA.is_dir():
    os.environ.setdefault("H2O_DATA", str(SHARED_DATA))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """`model` on every test that uses the embedded model's fixture; `data` tests skip one by one when the
    data folder is absent (the other markers are written on the tests)."""
    no_data = pytest.mark.skip(reason=f"data folder {SHARED_DATA} not present (set $H2O_DATA)")
    for item in items:
        if "smollm" in item.fixturenames:
            item.add_marker(pytest.mark.model)
        if item.get_closest_marker("data") and not SHARED_DATA.is_dir():
            item.add_marker(no_data)


# The tiny random-weight shape every family's unit tests use (GQA: 6 query heads over 2 KV heads).
TINY_SIZES = dict(
    vocab_size=128,
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def tiny_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_SIZES, "rope_theta": 10000.0, **overrides})


def feed_chunk(layer, q, k, v, start: int) -> torch.Tensor:
    """One chunk to a cache layer as the model hands it over (q [n_heads, c, d] and k [n_kv, c, d] rotated at
    their original positions `start ..`). Returns the attention output [n_heads, c, d]."""
    from h2o_cli.cache.positions import rotate

    positions = torch.arange(start, start + k.shape[1])
    cos, sin = layer.rope.cos_sin(positions, k.dtype)
    layer.update(rotate(k, cos, sin)[None], v[None], kwargs={"position_ids": positions[None]})
    return layer.attend(rotate(q, cos, sin)[None], q.shape[-1] ** -0.5)[0].transpose(0, 1)


def feed_torch_and_c(torch_layer, c_layer, q, k, v, start: int, c_calls) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk (as `feed_chunk`) to a torch-step layer, then to a C-step layer: their outputs (torch's, C's).
    `c_calls`, a mock wrapping `native.step`, proves the two took different paths: the torch layer made no C
    call, and the C layer one exactly when the call is a one-token step of a full store (its C step)."""
    before = c_calls.call_count
    c_step = q.shape[1] == 1 and c_layer.store.length == c_layer.store.budget
    want = feed_chunk(torch_layer, q, k, v, start)
    assert c_calls.call_count == before, "the torch layer called the C step"
    got = feed_chunk(c_layer, q, k, v, start)
    assert c_calls.call_count == before + c_step, f"token {start}: the C layer's C calls, want {int(c_step)}"
    return want, got


def feed_against_naive(
    layer, settings, inv_freq, chunks, n_heads: int, after_chunk=None, dtype=torch.float64, pinned=frozenset()
) -> None:
    """Random chunks (spiky logits, so a few tokens become heavy hitters) through `layer` and through the naive
    simulation (tests/naive.py): after each chunk the outputs and every KV head's kept tokens must agree (a chunk
    given as (size, asks) ends in a question of `asks` tokens, `H2OCache.asking`);
    `after_chunk(store)` adds the caller's own checks. `dtype`: what the layer is given (float32: the model's
    dtype, which the one-token steps of a float32 store take; the naive simulation gets the same values).
    `pinned`: the token indices the layer's store was pinned with, which the simulation never evicts either."""
    from naive import NaiveHeadState, naive_attend_chunk

    store = layer.store
    n_kv, head_dim = store.n_kv_heads, store.head_dim
    heads = [NaiveHeadState() for _ in range(n_kv)]
    start = 0
    for c in chunks:
        c, asks = c if isinstance(c, tuple) else (c, 0)  # (size, question tokens ending it)
        q = (torch.randn(n_heads, c, head_dim, dtype=torch.float64) * 2).to(dtype).double()
        k = (torch.randn(n_kv, c, head_dim, dtype=torch.float64) * 2).to(dtype).double()
        v = torch.randn(n_kv, c, head_dim, dtype=torch.float64).to(dtype).double()
        layer.asks = asks
        got = feed_chunk(layer, q.to(dtype), k.to(dtype), v.to(dtype), start).double()
        layer.asks = 0
        want = naive_attend_chunk(heads, q, k, v, start, settings, inv_freq, head_dim**-0.5, asks, pinned)
        # The model's rotary tables are float32 (cos/sin error ~1e-7); everything else is float64, or float32
        # throughout (softmax sums of ~20 terms: ~1e-6 relative, held to 1e-4 as the float32 decode tests are).
        tolerance = 1e-5 if dtype == torch.float64 else 1e-4
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        start += c
        for j, head in enumerate(heads):
            kept = sorted(store.token_index[j][store.valid[j]].tolist())
            assert kept == head.alive_indices(), f"head {j} after token {start}"
        if after_chunk is not None:
            after_chunk(store)


def run_stream(model, settings, ids: torch.Tensor, chunk: int):
    """`ids` [1, n] through a fresh `H2OCache(model, settings)` in chunks of `chunk`: (logits [1, n, vocab],
    the cache)."""
    from h2o_cli.cache import H2OCache

    cache = H2OCache(model, settings)
    with torch.no_grad():
        logits = [model(ids[:, s : s + chunk], cache=cache).logits for s in range(0, ids.shape[1], chunk)]
    return torch.cat(logits, 1), cache


def torch_threads() -> int:
    """Threads for the in-process model tests: up to 2, split between pytest-xdist's workers (`-n auto`
    starts one per core), so parallel workers do not oversubscribe the cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, (os.cpu_count() or 1) // workers))


@pytest.fixture
def tiny_pair():
    """(reference model with sdpa attention, identical model for the H2O cache). Separate configs, same weights."""
    torch.manual_seed(0)
    config = tiny_config()
    reference = __import__("transformers").LlamaForCausalLM(config).eval()
    model = __import__("transformers").LlamaForCausalLM(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model


def word_tokenizer(size: int):
    """A word-level tokenizer of `size` ids ("w0" .. "w{size-1}"), for lm-eval models of a tiny random Llama."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{number}": number for number in range(size)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="w1", bos_token="w2", pad_token="w1")


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M (model, tokenizer); converted once into $H2O_HOME."""
    from h2o_cli.models import load_model

    torch.set_num_threads(torch_threads())
    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def plain_smollm(smollm):
    """The embedded model's weights in a plain transformers model (sdpa attention, no h2o code): the reference
    a cache that evicts nothing must equal."""
    from transformers import AutoModelForCausalLM

    model, _ = smollm
    config = copy.deepcopy(model.config)
    config._attn_implementation = "sdpa"
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    plain.load_state_dict(model.state_dict())
    return plain


@pytest.fixture(scope="session")
def excerpt() -> str:
    """A real-text excerpt shipped in the repo (Frankenstein, Project Gutenberg, public domain)."""
    return (FIXTURES / "frankenstein_excerpt.txt").read_text(encoding="utf-8")


def assert_same_store(ours, theirs, where) -> None:
    """Two `LayerStore`s after the same steps (a C step's and the torch step's): the same entries, ranks and
    counters; scores to float tolerance. `where` labels a failure."""
    for name in ("valid", "token_index", "rank"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), (name, where)
    for name in ("scores", "seen", "last_probs"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=2e-5, atol=2e-5)
    counters = ("length", "tokens_seen", "evictions", "active")
    assert [getattr(ours, name) for name in counters] == [getattr(theirs, name) for name in counters], where
