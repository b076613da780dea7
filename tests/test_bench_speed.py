"""`h2o bench`'s comparison with plain transformers: the byte model, the ratios, and the runs behind them.

Arithmetic is checked against hand-computed values; the runs on a tiny model check what was measured (which
attention, which cache, how many tokens), never how fast.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from h2o_cli import bench, bench_speed
from h2o_cli.bench_speed import ByteModel


def test_byte_model_of_a_tiny_model_counts_every_weight_and_the_kv_of_each_token(tiny_pair):
    _, model = tiny_pair  # 2 layers, hidden 96, 6 heads / 2 KV heads of 16 dims, MLP 192, vocab 128, untied
    layer = 96 * 96 * 2 + 32 * 96 * 2 + 192 * 96 * 3 + 2 * 96  # q, o; k, v; gate, up, down; two norms
    params = 2 * 128 * 96 + 2 * layer + 96  # embedding + lm_head, layers, final norm
    byte_model = ByteModel.of(model)
    assert byte_model.weight_bytes == params * 4 == 739_200
    assert byte_model.kv_bytes_per_token == 2 * 2 * 16 * 2 * 4  # layers x KV heads x dims x (K, V) x fp32
    assert byte_model.bytes_per_token(1000) == 739_200 + 512_000
    assert byte_model.ceiling(1000, 100) == pytest.approx(1_251_200 / 790_400)


def test_byte_model_of_smollm2_gives_the_issue_figures():
    """SmolLM2-135M's shape (built on the meta device, no weights read): 46,080 bytes of K/V per cached token,
    585 / 727 MB per token for a full cache at 1K / 4K, 543 / 557 MB for h2o at 10%, ceilings 1.08 / 1.30."""
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    byte_model = ByteModel.of(model)
    assert byte_model.kv_bytes_per_token == 30 * 3 * 64 * 2 * 4 == 46_080
    assert round(byte_model.weight_bytes / 1e6) == 538
    assert [round(byte_model.bytes_per_token(n) / 1e6) for n in (1024, 4096, 102, 410)] == [
        585,
        727,
        543,
        557,
    ]
    assert round(byte_model.ceiling(1024, 102), 2) == 1.08 and round(byte_model.ceiling(4096, 410), 2) == 1.30


def test_floor_share_and_summary_medians():
    assert bench_speed.floor_share(10**9, 10.0, 20e9) == pytest.approx(0.5)
    byte_model = ByteModel(weight_bytes=1000, kv_bytes_per_token=10)
    rows = [
        {"round": 1, "context": 100, "budget": 10, "first": "plain", "plain": 4.0, "h2o": 5.0, "ratio": 1.25},
        {"round": 2, "context": 100, "budget": 10, "first": "h2o", "plain": 6.0, "h2o": 6.0, "ratio": 1.0},
        {"round": 3, "context": 100, "budget": 10, "first": "plain", "plain": 5.0, "h2o": 7.5, "ratio": 1.5},
    ]
    (m,) = bench_speed.summary(rows, byte_model, bandwidth=11_000.0)
    assert (m["plain"], m["h2o"], m["ratio"], m["rounds"]) == (5.0, 6.0, 1.25, 3)
    assert m["plain_bytes"] == 2000 and m["h2o_bytes"] == 1100 and m["ceiling"] == pytest.approx(2000 / 1100)
    assert m["plain_floor"] == pytest.approx(2000 * 5.0 / 11_000) and m["h2o_floor"] == pytest.approx(0.6)


def test_copy_bandwidth_counts_read_and_write(monkeypatch):
    ticks = iter([0.0, 0.5] * 3)  # every copy "takes" 0.5 s
    monkeypatch.setattr(bench_speed.time, "perf_counter", lambda: next(ticks))
    assert bench_speed.copy_bandwidth(nbytes=4096, repeats=3) == pytest.approx(2 * 4096 / 0.5)


def test_paired_decode_alternates_rounds_and_measures_plain_transformers_and_h2o(tiny_pair, monkeypatch):
    _, model = tiny_pair
    ids = torch.randint(
        0, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    seen = []  # (side, attention implementation, cache type, tokens in the cache before decoding)
    decode = bench_speed.greedy_decode

    def watched(model, cache, token, tokens):
        side = "plain" if isinstance(cache, DynamicCache) else "h2o"
        seen.append((side, model.config._attn_implementation, cache.get_seq_length()))
        return decode(model, cache, token, tokens)

    monkeypatch.setattr(bench_speed, "greedy_decode", watched)
    rows = bench_speed.paired_decode(model, ids, (40, 100), 0.1, tokens=3, rounds=2, chunk=16, progress=str)
    assert [(r["round"], r["context"], r["budget"], r["first"]) for r in rows] == [
        (1, 40, 4, "plain"), (1, 100, 10, "plain"), (2, 40, 4, "h2o"), (2, 100, 10, "h2o")
    ]  # fmt: skip
    assert seen == [
        ("plain", "sdpa", 40), ("h2o", "h2o", 40), ("plain", "sdpa", 100), ("h2o", "h2o", 100),
        ("h2o", "h2o", 40), ("plain", "sdpa", 40), ("h2o", "h2o", 100), ("plain", "sdpa", 100),
    ]  # fmt: skip
    assert model.config._attn_implementation == "h2o"  # the model is left as it was
    assert all(r["ratio"] == pytest.approx(r["h2o"] / r["plain"]) and r["plain"] > 0 for r in rows)


def test_plain_side_decodes_what_transformers_generate_does(tiny_pair):
    """The plain column is plain transformers: its greedy tokens equal `generate`'s with sdpa attention."""
    reference, model = tiny_pair
    ids = torch.randint(
        0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    with torch.inference_mode():
        want = reference.generate(torch.tensor([ids[:40]]), max_new_tokens=5, do_sample=False)[
            0, 40:
        ].tolist()
    cache = DynamicCache(config=model.config)
    with bench_speed.plain_attention(model):
        token = bench_speed.fill(model, cache, ids[:40], chunk=16)
        got = [token]
        for _ in range(4):
            got.append(bench_speed.greedy_decode(model, cache, got[-1], 1)[1])
    assert got == want


def test_stream_speed_with_a_budget_covering_the_text_equals_plain_perplexity(tiny_pair):
    """SPEC: with the budget covering everything h2o's perplexity is the full-attention one, so both columns
    read the same text the same way (and the plain one really attends over everything)."""
    _, model = tiny_pair
    ids = torch.randint(
        0, model.config.vocab_size, (120,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    result = bench_speed.stream_speed(model, ids, tokens=100, chunk=16, budget="120")
    assert result["plain_ppl"] == pytest.approx(result["h2o_ppl"], rel=1e-4)
    assert result["ratio"] == pytest.approx(result["h2o"] / result["plain"])
    small = bench_speed.stream_speed(model, ids, tokens=100, chunk=16, budget="8")
    assert small["h2o_ppl"] != pytest.approx(small["plain_ppl"], rel=1e-4)  # evicting changes it


def test_bench_markdown_prints_ratio_ceiling_and_floor_share():
    plan = bench.BenchPlan(parts=("speed",), decode_tokens=3, chunk=16)
    report = bench.BenchReport(threads=1, plan=plan, bandwidth=11_000.0,
                               byte_model=ByteModel(weight_bytes=1000, kv_bytes_per_token=10))  # fmt: skip
    report.speed = [
        {"round": 1, "context": 100, "budget": 10, "first": "plain", "plain": 4.0, "h2o": 5.0, "ratio": 1.25}
    ]
    text = bench.markdown(report, "h2o bench --only speed --threads 1")
    assert text.startswith("<!-- bench-speed-threads-1:begin -->")
    assert text.endswith("<!-- bench-speed-threads-1:end -->")
    assert "| 100 | 4.00 | 5.00 | **1.25×** | 1.82× |" in text and "| 73% | 50% |" in text
    assert "torch threads 1" in text


def test_bench_only_rejects_unknown_parts(monkeypatch, capsys, tmp_path):
    from h2o_cli.cli.app import main

    monkeypatch.setattr("sys.argv", ["h2o", "bench", "--only", "speed,warp", "--data-dir", str(tmp_path)])
    book = tmp_path / bench.BOOK
    book.parent.mkdir(parents=True)
    book.write_text("text")
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 2 and "warp" not in capsys.readouterr().out


def test_bench_contexts_option_parses_counts_and_rejects_words():
    from h2o_cli.cli.bench import parse_contexts
    from h2o_cli.errors import UsageError

    assert parse_contexts("4096,1024") == (1024, 4096)
    with pytest.raises(UsageError, match="--contexts"):
        parse_contexts("1k")
