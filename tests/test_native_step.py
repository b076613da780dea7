"""The CPU decode step as one C function (h2o_kernels.native.step, h2o_cli.cache.c_step) against the torch step it replaces: the same
outputs and the same store state, token by token, for every setting it takes; and what happens without it."""

from __future__ import annotations

import logging
from unittest import mock

import pytest
import torch
from conftest import assert_same_store, feed_against_naive, feed_chunk, feed_torch_and_c, tiny_config
from h2o_kernels import native
from naive import inv_freq_of
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from h2o_cli.cache import H2OLayer
from h2o_cli.cache.model_cache import check_kernels
from h2o_cli.cache.positions import Rope
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError

N_HEADS, N_KV, HEAD_DIM = 6, 2, 16
needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


CONFIG = tiny_config(hidden_size=N_HEADS * HEAD_DIM, num_attention_heads=N_HEADS, num_key_value_heads=N_KV)


def make_layer(kernels: str, policy: str = "h2o", positions: str = "rolling", **extra) -> H2OLayer:
    rope = Rope(LlamaRotaryEmbedding(CONFIG), HEAD_DIM)
    settings = CacheSettings(budget=10, chunk=6, policy=policy, positions=positions, kernels=kernels, **extra)
    settings = settings.resolved(512)
    store = LayerStore(N_KV, HEAD_DIM, settings.budget, 6, torch.float32, torch.device("cpu"))
    return H2OLayer(store, settings, rope, 512)


def run_both(steps: int, **options) -> int:
    """The same chunks (two prefill chunks, then one-token steps) through a torch-path and a C-path layer,
    comparing the outputs and every piece of store state after each call, and counting the C calls
    (`native.step`): none from the torch layer, one for each one-token call of the C layer once its store is
    full (else both arms ran the torch step and the comparison proved nothing). Returns the C calls."""
    torch_layer, c_layer = make_layer("torch", **options), make_layer("native", **options)
    torch.manual_seed(7)
    start = 0
    with mock.patch.object(native, "step", wraps=native.step) as c_calls:
        for chunk in [6, 5] + [1] * steps:
            q = torch.randn(N_HEADS, chunk, HEAD_DIM) * 2
            k = torch.randn(N_KV, chunk, HEAD_DIM) * 2
            v = torch.randn(N_KV, chunk, HEAD_DIM)
            want, got = feed_torch_and_c(torch_layer, c_layer, q, k, v, start, c_calls)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            assert_same_store(c_layer.store, torch_layer.store, start)
            start += chunk
    return c_calls.call_count


def run_native_against_naive(steps: int, **options) -> H2OLayer:
    """A `--kernels native` layer on float32 chunks (the dtype the steps take) against the naive simulation
    (tests/naive.py), call by call, where the C step must not run: returns the layer after asserting that no
    C call was made."""
    layer = make_layer("native", **options)
    torch.manual_seed(7)
    with mock.patch.object(native, "step", wraps=native.step) as c_calls:
        feed_against_naive(
            layer, layer.settings, inv_freq_of(CONFIG, HEAD_DIM), [6, 5] + [1] * steps, N_HEADS,
            dtype=torch.float32,
        )  # fmt: skip
    assert c_calls.call_count == 0
    return layer


@needs_compiler
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"positions": "original"},
        {"score_decay": 0.95},
        {"heavy_ratio": 0.8},
    ],
    ids=["rolling", "original", "decay", "mostly-heavy"],
)
def test_c_step_equals_the_torch_step(options):
    assert run_both(60, **options) == 60  # every step after the prefill filled the cache: in C


@pytest.mark.parametrize("options", [{"policy": "local"}, {"policy": "h2o", "score_norm": "mean"}])
def test_policies_with_another_victim_rule_keep_the_torch_step(options):
    """The C step knows one victim rule (`kernel_victim`); other policies' steps follow docs/spec.md in torch."""
    assert run_native_against_naive(20, **options)._c_buffers is None


@needs_compiler
def test_c_step_is_one_call_in_place_of_the_ops(monkeypatch):
    """Each full-cache decode call of the layer is one C call (counted), and no C call happens while the
    cache still fills (the torch step does those)."""
    calls = []
    real = native.step
    monkeypatch.setattr(native, "step", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    layer, steps = make_layer("native"), 0
    torch.manual_seed(1)
    for start in range(40):
        q, k, v = (
            torch.randn(N_HEADS, 1, HEAD_DIM),
            torch.randn(N_KV, 1, HEAD_DIM),
            torch.randn(N_KV, 1, HEAD_DIM),
        )
        full = layer.store.length == layer.store.budget
        feed_chunk(layer, q, k, v, start)
        steps += full
    assert len(calls) == steps == 40 - 10


@pytest.fixture
def no_library(monkeypatch, tmp_path):
    """A process where the C step was never built: an empty $H2O_HOME and the caches cleared (again after)."""
    monkeypatch.setenv("H2O_HOME", str(tmp_path))
    native.library.cache_clear()
    native.available.cache_clear()
    yield tmp_path
    native.library.cache_clear()
    native.available.cache_clear()


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "false"])
def test_without_a_working_compiler_the_torch_path_runs(no_library, monkeypatch, caplog, compiler):
    """`--kernels native` with no compiler (or one that fails) says so in one warning line and decodes on the
    torch path, by docs/spec.md (the naive simulation)."""
    monkeypatch.setenv("CC", compiler)
    with caplog.at_level(logging.INFO, logger="h2o_kernels"):
        layer = run_native_against_naive(20)
    assert layer._c_buffers is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1 and "C kernels (decode step, read softmax) unavailable" in warnings[0].getMessage()
    )
    assert "\n" not in warnings[0].getMessage()
    assert not list(no_library.glob("kernels/*.so"))


def test_auto_without_a_compiler_is_quiet(no_library, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="h2o_kernels"):
        layer = make_layer("auto")
        feed_chunk(layer, *(torch.randn(n, 11, HEAD_DIM) for n in (N_HEADS, N_KV, N_KV)), 0)
        feed_chunk(layer, *(torch.randn(n, 1, HEAD_DIM) for n in (N_HEADS, N_KV, N_KV)), 11)
    assert layer._c_buffers is None
    assert not caplog.records


@needs_compiler
def test_library_is_built_once_per_cpu(no_library, monkeypatch):
    first = native.build(no_library)
    assert first.exists() and native.build(no_library) == first
    monkeypatch.setattr(native, "cpu_signature", lambda: "another cpu")
    assert native.build(no_library) != first  # -march=native code is not shared between CPUs


def test_native_is_refused_off_the_cpu():
    with pytest.raises(UsageError, match="--kernels native"):
        check_kernels("native", torch.device("cuda"))
    check_kernels("native", torch.device("cpu"))


@needs_compiler
def test_softmax_exp_is_within_two_ulp():
    """The C step's e**x (a polynomial, for x <= 0) against float64 exp: within 2 units in the last place
    over float32's normal range, and exactly 0 below it and for a masked (-inf) logit."""
    x = torch.cat([-torch.logspace(-8, 1.94, 200_001).clamp(max=87.0), torch.tensor([0.0])])
    out = torch.empty_like(x)
    native.library().h2o_exp_nonpositive(x.data_ptr(), out.data_ptr(), x.numel())
    want = torch.exp(x.double())
    nearest = want.float()
    ulp = (
        torch.nextafter(nearest, torch.tensor(float("inf"))).double() - nearest.double()
    )  # in float64: no flush
    assert ((out.double() - want).abs() <= 2 * ulp).all()
    below = torch.tensor([-87.5, -100.0, -1e30, float("-inf")])
    native.library().h2o_exp_nonpositive(below.data_ptr(), out.data_ptr(), below.numel())
    assert out[:4].eq(0).all()
