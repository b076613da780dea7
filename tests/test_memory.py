"""int8 KV cache, quantised weights and the memory accounting of `h2o_cli.memory` / `h2o memory`."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from h2o_cli import memory
from h2o_cli.cache import H2OCache
from h2o_cli.cache.kvquant import dequantize, quantize
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError
from h2o_cli.models import quant_backend
from h2o_cli.policies import policy_names

LLAMA_7B = dict(  # huggyllama/llama-7b config.json
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    intermediate_size=11008,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def test_int8_roundtrip_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    states = torch.randn(3, 50, 64) * torch.rand(3, 50, 1) * 10
    quantized, scales = quantize(states)
    error = (dequantize(quantized, scales, torch.float32) - states).abs()
    assert quantized.dtype == torch.int8 and scales.shape == (3, 50)
    assert (error <= scales.unsqueeze(-1) / 2 + 1e-6).all()


def test_int8_kv_attention_matches_fp32_reference():
    """Tolerance: the fp32 reference's output moves by at most 2% of max|V| (int8 step = max|x|/127)."""
    from h2o_kernels import slot_attention  # after h2o_cli (the kernels import h2o_cli.cache.positions)

    torch.manual_seed(1)
    n_heads, n_kv, chunk, slots, dim = 6, 2, 5, 63, 32
    query = torch.randn(n_heads, chunk, dim)
    keys, values = torch.randn(n_kv, slots, dim), torch.randn(n_kv, slots, dim)
    allowed = torch.rand(n_kv, chunk, slots) > 0.2
    allowed[..., 0] = True
    cos, sin = torch.ones(slots, dim), torch.zeros(slots, dim)
    args = (allowed, cos[:chunk], sin[:chunk], cos.expand(n_kv, -1, -1), sin.expand(n_kv, -1, -1), dim**-0.5)
    reference = slot_attention(query, keys, values, *args)
    k8, v8 = (dequantize(*quantize(x), torch.float32) for x in (keys, values))
    approx = slot_attention(query, k8, v8, *args)
    assert (approx[0] - reference[0]).abs().max() <= 0.02 * values.abs().max()
    assert torch.allclose(approx[1], reference[1], atol=0.02)  # scores, hence eviction, barely move


@pytest.mark.parametrize("policy", policy_names())
def test_int8_cache_composes_with_every_policy(tiny_pair, policy):
    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    outputs = {}
    for kv_bits in (None, 8):
        positions = "original" if policy == "full" else "rolling"
        cache = H2OCache(
            model, CacheSettings(budget=12, policy=policy, chunk=4, positions=positions, kv_bits=kv_bits)
        )
        with torch.no_grad():
            logits = [
                model(input_ids=ids[:, i : i + 4], cache=cache, use_cache=True).logits
                for i in range(0, 40, 4)
            ]
        outputs[kv_bits] = torch.cat(logits, 1)
        assert cache.stores[0].keys.dtype == (torch.int8 if kv_bits == 8 else torch.float32)
    assert (outputs[8] - outputs[None]).abs().max() < 0.05 * outputs[None].abs().max()


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_eval_and_compare_caches_store_int8_when_asked(tiny_pair, policy):
    """`h2o eval` / `h2o compare --kv-bits 8` reach the cache: int8 stores, perplexity within 2% of fp32."""
    from h2o_cli.eval.compare import compare_perplexity
    from h2o_cli.eval.scoring import CachePool

    _, model = tiny_pair
    for kv_bits, dtype in ((None, torch.float32), (16, torch.float16), (8, torch.int8)):
        pool = CachePool(model, CacheSettings(budget=0.5, policy=policy, kv_bits=kv_bits))
        assert pool.cache_for(40, 4).stores[0].keys.dtype == dtype
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ppl = {
        kv_bits: compare_perplexity(
            model, ids, [0.5], [policy], CacheSettings(budget=1.0, chunk=4, kv_bits=kv_bits)
        )[0]
        for kv_bits in (None, 8)
    }
    assert ppl[8]["kv_bits"] == 8
    assert ppl[8]["ppl"] == pytest.approx(ppl[None]["ppl"], rel=0.02)


def test_kv_bits_is_checked():
    with pytest.raises(UsageError, match="--kv-bits"):
        CacheSettings(budget=8, kv_bits=4)


def test_quant_backend_and_its_errors():
    assert quant_backend("none", torch.device("cpu")) == "none"
    with pytest.raises(UsageError, match="--quant"):
        quant_backend("3bit", torch.device("cpu"))
    pytest.importorskip("bitsandbytes")
    assert quant_backend("4bit", torch.device("cpu")) == "bitsandbytes"
    with pytest.raises(UsageError, match="does not run on meta"):
        quant_backend("8bit", torch.device("meta"))


def test_llama_7b_matches_public_config_arithmetic():
    shape = memory.ModelShape.from_config(SimpleNamespace(**LLAMA_7B))
    assert shape.params() == 6_738_415_616  # LLaMA-7B's published parameter count
    assert memory.weight_bytes(shape, "none", 2) == 2 * 6_738_415_616
    # fp16 K and V: 32 layers x 32 heads x 128 dims x 2 x 2 bytes = 512 KiB per token.
    table = memory.memory_table(shape, budget=400, chunk=100, dtype_bytes=2, contexts=(4096,))
    row = table["rows"][0]
    assert row["full_kv_bytes"] == 4096 * 512 * 1024 and not row["within_window"]
    assert row["full_kv_bytes_per_head"] == 4096 * 128 * 2 * 2
    assert row["h2o_kv_bytes_per_head"] == 500 * (128 * 2 * 2 + 29)
    assert row["h2o_kv_bytes"] == 32 * 32 * 500 * (512 + 29)
    linears = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    rows = 32 * (4 * 4096 + 2 * 11008 + 4096)
    assert memory.weight_bytes(shape, "8bit", 2) == 2 * (6_738_415_616 - linears) + linears + 4 * rows
    int8 = memory.memory_table(shape, budget=400, chunk=100, kv_bits=8, dtype_bytes=2, contexts=(4096,))
    assert int8["rows"][0]["full_kv_bytes_per_head"] == 4096 * (128 * 2 + 8)


def test_memory_cli_works_offline_for_llama_7b(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty hub cache: the built-in config must answer
    from typer.testing import CliRunner

    from h2o_cli.cache.recall.limits import archive_storage, auto_ram_bytes
    from h2o_cli.cli.app import app

    result = CliRunner().invoke(
        app, ["memory", "--model", "llama-7b", "--budget", "0.2", "--dtype", "float16", "--json"]
    )
    assert result.exit_code == 0, result.output
    table = json.loads(result.stdout)
    assert table["config_source"] == "built-in public config" and table["budget_tokens"] == 410
    assert table["weights_bytes"] == 2 * 6_738_415_616
    assert table["rows"][0]["context"] == 4096 and table["rows"][-1]["context"] == 2**20
    # recall's archive, by hand: 32 layers x (K and V of 32 heads x 128 fp16 + an int64 index + fp32 min/max
    # of 32 x 128 per 4-token block, the default block), a reach of 1,048,576 tokens by default.
    per_token = 32 * (2 * 32 * 128 * 2 + 8 + 2 * 32 * 128 * 4 / 4)
    assert table["recall_archive_bytes_per_token"] == per_token
    assert table["recall_archive_bytes"] == per_token * 1_048_576
    # `--archive auto` keeps a text's archive in RAM while its K/V fit the limit: whole pages of 16 tokens
    kv_per_token = 32 * 2 * 32 * 128 * 2
    held = table["recall_archive_ram_up_to_tokens"]
    assert held % 16 == 0 and held * kv_per_token <= auto_ram_bytes() < (held + 16) * kv_per_token
    assert archive_storage("auto", held * kv_per_token, "cpu") == "ram"
    assert archive_storage("auto", (held + 16) * kv_per_token, "cpu") == "disk"
    quarter = CliRunner().invoke(
        app, ["memory", "--model", "llama-7b", "--budget", "0.2", "--dtype", "float16", "--json",
              "--recall-layers", "0-3,20,28-30"],
    )  # fmt: skip
    assert quarter.exit_code == 0, quarter.output
    table = json.loads(quarter.stdout)  # the archive of 8 layers of 32
    assert table["recall_layers"] == 8 and table["recall_archive_bytes"] == per_token * 1_048_576 // 4


def test_recall_archive_accounting_equals_the_cache(tiny_pair):
    from h2o_cli.runtime import cache_summary
    from h2o_cli.streaming import stream_perplexity

    _, model = tiny_pair
    cache = H2OCache(model, CacheSettings(budget=32, policy="recall", chunk=8, page_size=8, archive_max=100))
    stream_perplexity(model, cache, [list(range(120))], 8)
    shape = memory.ModelShape.from_config(model.config)
    summary = cache_summary(cache)
    # 100 tokens: 13 pages of 8, summarised in blocks of 4 (the default block)
    assert summary["archive_bytes"] == memory.archive_bytes(shape, 104, 4, 4)
    assert summary["archive_tokens"] == 120 - 16 and summary["archive_oldest"] == 16


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_smollm_accounting_equals_measured_cache_bytes(smollm, excerpt, kv_bits):
    from h2o_cli.runtime import cache_summary
    from h2o_cli.streaming import stream_perplexity

    model, tokenizer = smollm
    ids = tokenizer(excerpt)["input_ids"][:200]
    cache = H2OCache(model, CacheSettings(budget=64, chunk=32, kv_bits=kv_bits))
    stream_perplexity(model, cache, [ids], 32)
    shape = memory.ModelShape.from_config(model.config)
    assert (shape.n_layers, shape.n_kv_heads, shape.head_dim) == (30, 3, 64)
    assert cache.nbytes() == memory.h2o_cache_bytes(shape, 64, 32, kv_bits, 4)
    summary = cache_summary(cache)
    assert summary["kv_cache_bytes"] == cache.nbytes()
    assert summary["kv_cache_bytes_per_head"] * 90 == cache.nbytes()


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["8bit", "4bit"])
def test_quantised_weight_bytes_match_the_loaded_model(quant):
    pytest.importorskip("bitsandbytes")
    from h2o_cli.models import load_model

    model, _ = load_model("smollm2-135m", device="cpu", dtype="float32", quant=quant)
    measured = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        scb = getattr(getattr(module, "weight", None), "SCB", None)
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if scb is not None:
            measured += scb.numel() * scb.element_size()
        if state is not None:
            assert state.blocksize == memory.NF4_BLOCK
            measured += state.absmax.numel() * state.absmax.element_size() + state.code.numel() * 4
    shape = memory.ModelShape.from_config(model.config)
    assert measured == memory.weight_bytes(shape, quant, 4)
    cache = H2OCache(model, CacheSettings(budget=16, chunk=8, kv_bits=8))
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]), cache=cache, use_cache=True)
    assert cache.stores[0].compute_dtype == torch.float32


RSS_SCRIPT = """
import json, psutil, torch
from h2o_cli import memory
from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.models import load_model
from h2o_cli.runtime import peak_rss_bytes
from h2o_cli.streaming import stream_perplexity
torch.set_num_threads(1)
def rss():
    return psutil.Process().memory_info().rss
base = rss()
model, tokenizer = load_model('smollm2-135m', device='cpu', dtype='float32')
cache = H2OCache(model, CacheSettings(budget=1024, chunk=256))
with torch.no_grad():  # one token pages in the (memory-mapped) weights
    warm = H2OCache(model, CacheSettings(budget=4, chunk=1))
    model(input_ids=torch.tensor([[1]]), cache=warm, use_cache=True)
loaded = rss()
stream_perplexity(model, cache, [list(range(1000, 1800))], 256)
shape = memory.ModelShape.from_config(model.config)
act = memory.activation_bytes(shape, 256, 1280, None, 4)['peak']
weights = memory.weight_bytes(shape, 'none', 4)
print(json.dumps(dict(base=base, loaded=loaded, peak=peak_rss_bytes(), weights=weights, kv=cache.nbytes(),
    act=act)))
"""


@pytest.mark.slow
def test_measured_rss_agrees_with_the_accounting():
    """Weights + KV within 15% of the RSS growth once the weights are paged in; the stream's peak above that
    within 2x the planned activation peak (+64 MiB for allocator slack)."""
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True, check=True
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    grown = figures["loaded"] - figures["base"]
    planned = figures["weights"] + figures["kv"]
    assert abs(grown - planned) <= 0.15 * planned, figures
    assert figures["peak"] - figures["loaded"] <= 2 * figures["act"] + 64 * 2**20, figures
