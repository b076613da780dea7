"""The kernel switch (`--kernels`, $H2O_KERNELS) and the fallback from a failing Triton kernel to the torch path.

No GPU and no triton needed: the Triton entry points are replaced by functions that raise, as a kernel
that fails to compile or launch would, and `triton_possible` is told the CPU can run them.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from h2o_kernels import dispatch
from h2o_kernels import prefill as prefill_ref

from h2o_cli import config
from h2o_cli.cache import H2OCache
from h2o_cli.cache import devices as cache_devices
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError


def broken(*args):
    raise RuntimeError("simulated: ptxas could not compile the kernel\nsecond line of the compiler's output")


def run(model, settings: CacheSettings, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Logits of two prefill chunks (the second evicts) and 16 decode steps (one eviction each), and the
    final (token index, scores) of every layer."""
    cache = H2OCache(model, settings)
    logits = []
    with torch.inference_mode():
        for piece in (ids[:, :12], ids[:, 12:20]):
            logits.append(model(input_ids=piece, cache=cache, use_cache=True).logits[0])
        for step in range(20, ids.shape[1]):
            logits.append(model(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True).logits[0])
    return torch.cat(logits), [(s.token_index.clone(), s.scores.clone()) for s in cache.stores]


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """A process where no Triton kernel has failed yet, and where the CPU counts as a Triton device."""
    monkeypatch.setattr(dispatch, "_failure", None)
    monkeypatch.setattr(dispatch, "triton_possible", lambda device: True)
    monkeypatch.setattr(cache_devices, "triton_possible", lambda device: True)  # `--kernels triton` accepted
    monkeypatch.delenv(dispatch.ENV, raising=False)
    return monkeypatch


@pytest.mark.parametrize("failing", ["prefill", "decode"])
def test_failing_triton_kernel_falls_back_to_the_torch_path_with_one_warning(
    tiny_pair, fresh_dispatch, caplog, failing
):
    """Whichever kernel fails first (prefill chunk, or a decode step after working prefills), the output,
    the kept tokens and the scores equal the torch path's, and one warning line is logged."""
    _, model = tiny_pair
    ids = torch.randint(0, model.config.vocab_size, (1, 36), generator=torch.Generator().manual_seed(0))
    settings = CacheSettings(budget=16, chunk=8, kernels="triton")
    torch_logits, torch_state = run(model, CacheSettings(budget=16, chunk=8, kernels="torch"), ids)

    fresh_dispatch.setattr(dispatch, "_triton_decode", broken)
    fresh_dispatch.setattr(
        dispatch, "_triton_prefill", broken if failing == "prefill" else prefill_ref.prefill_attention
    )
    with caplog.at_level(logging.WARNING, logger="h2o_kernels"):
        logits, state = run(model, settings, ids)

    torch.testing.assert_close(logits, torch_logits, rtol=1e-5, atol=1e-5)
    for (tokens, scores), (want_tokens, want_scores) in zip(state, torch_state, strict=True):
        assert torch.equal(torch.sort(tokens, dim=1).values, torch.sort(want_tokens, dim=1).values)
        torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-6)
    warnings = [record for record in caplog.records if record.name == "h2o_kernels"]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "\n" not in message and "simulated: ptxas" in message and "torch path" in message
    assert not dispatch.use_triton(torch.device("cpu"), "triton")  # given up for the rest of the process


@pytest.mark.parametrize(
    ("kernels", "env"),
    [("torch", None), ("auto", "torch"), ("auto", None)],
    ids=["torch", "env-torch", "auto"],
)
def test_these_settings_never_call_a_triton_kernel(tiny_pair, fresh_dispatch, kernels, env):
    """`--kernels torch`, $H2O_KERNELS=torch under `auto`, and plain `auto` (the torch path: the kernels were
    slower than it on an H200, dispatch.py) keep a Triton-capable device on the torch path."""
    _, model = tiny_pair
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    calls = []
    fresh_dispatch.setattr(dispatch, "_triton_decode", lambda *args: calls.append("decode"))
    fresh_dispatch.setattr(dispatch, "_triton_prefill", lambda *args: calls.append("prefill"))
    if env is not None:
        fresh_dispatch.setenv(dispatch.ENV, env)
    run(model, CacheSettings(budget=16, chunk=8, kernels=kernels), ids)
    assert calls == [] and dispatch._failure is None


def test_the_setting_wins_over_the_environment(fresh_dispatch):
    cpu = torch.device("cpu")  # counts as a Triton device here (fresh_dispatch)
    assert not dispatch.use_triton(cpu, "auto") and dispatch.use_triton(cpu, "triton")
    fresh_dispatch.setenv(dispatch.ENV, "triton")
    assert dispatch.use_triton(cpu, "auto")  # $H2O_KERNELS fills in `auto` only
    assert not dispatch.use_triton(cpu, "torch")


def test_kernels_triton_without_cuda_is_a_usage_error(tiny_pair, monkeypatch):
    _, model = tiny_pair
    monkeypatch.delenv(dispatch.ENV, raising=False)
    with pytest.raises(UsageError, match="--kernels triton needs a CUDA device"):
        H2OCache(model, CacheSettings(budget=16, chunk=8, kernels="triton"))
    monkeypatch.setenv(dispatch.ENV, "fast")
    with pytest.raises(UsageError, match="H2O_KERNELS"):
        H2OCache(model, CacheSettings(budget=16, chunk=8))
    with pytest.raises(UsageError, match="--kernels 'cuda' is unknown"):
        CacheSettings(budget=16, kernels="cuda")


def test_settings_and_dispatch_name_the_same_choices():
    assert config.KERNELS == dispatch.KERNELS


def test_fallback_warning_is_one_line_on_stderr():
    """Without any logging setup (as in the CLI) the warning reaches stderr as one line, once."""
    script = textwrap.dedent(
        """
        import torch
        from h2o_kernels import dispatch
        def broken(*args):
            raise RuntimeError("simulated launch failure\\nmore compiler output")
        dispatch.triton_possible = lambda device: True
        dispatch._triton_decode = broken
        n_kv, slots, d = 2, 8, 4
        args = (torch.randn(4, d), torch.randn(n_kv, slots, d), torch.randn(n_kv, slots, d),
                torch.ones(n_kv, slots, dtype=torch.bool), torch.zeros(n_kv, slots, dtype=torch.long),
                torch.zeros(n_kv, slots, dtype=torch.long), torch.zeros(n_kv, slots, dtype=torch.long), 0,
                torch.ones(2, d), torch.zeros(2, d), 0.5, torch.zeros(n_kv, slots), 0)
        for _ in range(3):
            dispatch.decode_attention(*args, kernels="triton")
        print("ok")
        """
    )
    env = {**__import__("os").environ}
    env.pop(dispatch.ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "simulated launch failure" in lines[0] and "torch path" in lines[0]


def test_kernels_option_rejects_an_unknown_choice(monkeypatch, capsys):
    """`--kernels` is a cache option of the commands that build a cache; a wrong value is a usage error."""
    from h2o_cli.cli.app import main

    monkeypatch.setattr("sys.argv", ["h2o", "stream", "-", "--kernels", "cuda"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 2 and "cuda" in capsys.readouterr().err
