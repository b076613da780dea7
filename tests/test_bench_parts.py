"""`h2o bench --only recall` and `--only paired` end to end on a tiny random model saved to a folder: what they
count (tokens read and decoded, rounds, blocks) is what was asked, and every ratio and median they print is
recomputed here from the per-block timings they report. How fast anything runs is never checked."""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import pytest
import torch
from conftest import REPO, tiny_config, word_tokenizer
from transformers import LlamaForCausalLM

from h2o_cli.bench import BOOK


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """(model folder, data folder): a tiny random Llama with a word tokenizer, and a book of random words."""
    root = tmp_path_factory.mktemp("bench")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(root / "model")
    word_tokenizer(128).save_pretrained(root / "model")
    book = root / "data" / BOOK
    book.parent.mkdir(parents=True)
    words = random.Random(0)
    book.write_text(" ".join(f"w{words.randrange(3, 128)}" for _ in range(2000)), encoding="utf-8")
    return root / "model", root / "data"


def run_bench(monkeypatch, capsys, *args: str):
    """`h2o bench ARGS --json`: (exit code, the JSON report or None, stderr). Its own $H2O_HOME: a recall run
    calibrates the tiny model's lead head, which must not land in the user's calibration cache."""
    import tempfile

    from h2o_cli.cli.app import main

    monkeypatch.setenv("H2O_HOME", tempfile.mkdtemp(prefix="h2o_home_"))
    monkeypatch.setattr(sys, "argv", ["h2o", "bench", *args, "--json", "--threads", "1"])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    code = done.value.code or 0
    return code, json.loads(out.out) if code == 0 else None, out.err


def test_recall_part_counts_what_was_asked_and_its_ratios_are_the_quotients(
    tiny_folders, monkeypatch, capsys, tmp_path
):
    model, data = tiny_folders
    runs = ["h2o", "recall", "recall:archive_max=128"]
    context, rounds, decode, block, read_block, question = 200, 2, 5, 2, 64, "w5 w6 w7"
    doc = tmp_path / "bench.md"
    code, report, err = run_bench(
        monkeypatch, capsys, "--only", "recall", "--model", str(model), "--data-dir", str(data),
        "--contexts", str(context), "--budget", "48", "--chunk", "32", "--decode", str(decode),
        "--block", str(block), "--read-block", str(read_block), "--rounds", str(rounds),
        "--question", question, *[word for spec in runs for word in ("--run", spec)], "--out", str(doc),
    )  # fmt: skip
    assert code == 0, err
    (table,) = report["recall"]
    assert (table["context"], table["budget"]) == (context, 48)
    assert [row["run"] for row in table["rows"]] == runs
    base = table["rows"][0]
    base_speeds = [tokens / seconds for tokens, seconds in base["decode_blocks"]]
    for row in table["rows"]:
        read_tokens = [tokens for tokens, _ in row["read_blocks"]]
        assert row["read_tokens"] == sum(read_tokens) == rounds * (context + len(question.split()))
        assert len(read_tokens) == rounds * -(-context // read_block) and max(read_tokens) <= read_block + 3
        decoded = [tokens for tokens, _ in row["decode_blocks"]]
        assert row["decode_tokens"] == sum(decoded) == rounds * decode and max(decoded) == block
        read_rate = sum(read_tokens) / sum(seconds for _, seconds in row["read_blocks"])
        assert row["read_tok_s"] == pytest.approx(read_rate)
        assert row["read_ratio"] == pytest.approx(row["read_tok_s"] / base["read_tok_s"])
        speeds = [tokens / seconds for tokens, seconds in row["decode_blocks"]]
        assert row["decode_tok_s"] == pytest.approx(statistics.median(speeds))
        ratios = [mine / theirs for mine, theirs in zip(speeds, base_speeds, strict=True)]
        assert row["decode_ratio"] == pytest.approx(statistics.median(ratios))
        assert f"| {row['run']} | {row['read_tok_s']:.1f} | {row['read_ratio']:.2f}×" in doc.read_text()
    assert base["read_ratio"] == base["decode_ratio"] == 1.0
    text = doc.read_text()
    assert "<!-- bench-recall-threads-1:begin -->" in text and "<!-- bench-recall-threads-1:end -->" in text
    assert (
        "--run recall:archive_max=128" in text and f"--question '{question}'" in text
    )  # the command to rerun


def test_recall_part_refuses_an_unknown_field_before_loading_a_model(tiny_folders, monkeypatch, capsys):
    _, data = tiny_folders
    code, _, err = run_bench(
        monkeypatch, capsys, "--only", "recall", "--model", "no-such-model", "--data-dir", str(data),
        "--run", "h2o", "--run", "recall:no_such_field=1",
    )  # fmt: skip
    assert code == 2 and "no_such_field" in err


@pytest.mark.heavy
def test_paired_part_times_both_checkouts_in_rounds_and_reports_the_median_ratio(
    tiny_folders, monkeypatch, capsys, tmp_path
):
    """This checkout against itself: each worker imports the tree it was given (it says so before it is
    timed), decodes `rounds` blocks of `block` tokens, and the medians are those of the per-round speeds."""
    model, data = tiny_folders
    rounds, block = 3, 4
    code, report, err = run_bench(
        monkeypatch, capsys, "--only", "paired", "--old", str(REPO), "--new", str(REPO), "--model", str(model),
        "--data-dir", str(data), "--contexts", "96", "--budget", "0.25", "--chunk", "32",
        "--rounds", str(rounds), "--block", str(block), "--out", str(tmp_path / "bench.md"),
    )  # fmt: skip
    assert code == 0, err
    (row,) = report["paired"]
    assert (row["context"], row["budget"], row["rounds"], row["block"]) == (96, 24, rounds, block)
    assert row["old_tokens"] == row["new_tokens"] == rounds * block
    old, new = row["old_round_tok_s"], row["new_round_tok_s"]
    assert len(old) == len(new) == rounds
    assert row["old_tok_s"] == pytest.approx(statistics.median(old))
    assert row["new_tok_s"] == pytest.approx(statistics.median(new))
    q1, median, q3 = statistics.quantiles([n / o for n, o in zip(new, old, strict=True)], n=4)
    assert (row["ratio_q1"], row["ratio_median"], row["ratio_q3"]) == pytest.approx((q1, median, q3))
    assert f"| 96 | 24 | {row['old_tok_s']:.2f} | {row['new_tok_s']:.2f} | **{median:.3f}** |" in (
        tmp_path / "bench.md"
    ).read_text(encoding="utf-8")


@pytest.mark.parametrize("args", [[], ["--old", "/"]], ids=["no --old", "not a checkout"])
def test_paired_part_needs_an_old_checkout(tiny_folders, monkeypatch, capsys, args):
    _, data = tiny_folders
    code, _, err = run_bench(monkeypatch, capsys, "--only", "paired", "--data-dir", str(data), *args)
    assert code == 2 and ("--old" in err or "not a checkout" in err)


def test_streams_plan_caps_token_by_token_runs_and_full_at_the_window():
    from h2o_cli.bench_streams import StreamsPlan

    plan = StreamsPlan(
        policies=("full", "h2o"), lengths=(100, 300), chunks=(16, 1), chunk1_tokens=50, window=256
    )
    assert plan.runs() == [
        ("full", 16, 100), ("h2o", 16, 100), ("full", 1, 50), ("h2o", 1, 50),
        ("full", 16, 240), ("h2o", 16, 300),  # full stops a chunk short of the 256-token window
    ]  # fmt: skip


@pytest.mark.heavy
def test_streams_part_reports_what_plain_transformers_measure(tiny_folders, monkeypatch, capsys, tmp_path):
    """Each run is `h2o stream --dtype float32` in its own process: `full`'s perplexity over the first 120 words
    of the book is plain transformers' (fp32) over the same ids, and `local` with a budget covering them all reads the same."""
    model_dir, data = tiny_folders
    code, report, err = run_bench(
        monkeypatch, capsys, "--only", "streams", "--model", str(model_dir), "--data-dir", str(data),
        "--contexts", "120", "--chunks", "16", "--run", "full", "--run", "local", "--budget", "200",
        "--dtype", "float32", "--out", str(tmp_path / "bench.md"),
    )  # fmt: skip
    assert code == 0, err
    full, local = report["streams"]
    assert [(r["policy"], r["chunk"], r["asked"], r["tokens"]) for r in (full, local)] == [
        ("full", 16, 120, 120), ("local", 16, 120, 120)
    ]  # fmt: skip
    tokenizer = word_tokenizer(128)
    ids = tokenizer((data / BOOK).read_text(encoding="utf-8"))["input_ids"][:120]
    reference = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        loss = reference(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert full["ppl"] == pytest.approx(float(torch.exp(loss)), rel=1e-4)
    assert local["ppl"] == pytest.approx(full["ppl"], rel=1e-4) and local["budget_tokens"] == 200
    row = f"| local | 200 | 16 | 120 | {local['tokens_per_s']:.1f} | {local['ppl']:.3f} |"
    assert row in (tmp_path / "bench.md").read_text(encoding="utf-8")


def test_floor_part_ceilings_are_the_arithmetic_of_its_timings_and_the_model_shapes(
    tiny_folders, monkeypatch, capsys, tmp_path
):
    """`--only floor`: the linear shapes are the config's (each layer's q, k, v, o, gate, up, down and the lm
    head), every ceiling is recomputed from the per-shape timings, the bandwidth and the bytes a decode step
    reads; without llama-cpp-python the part says so in one line and the table says `not measured`."""
    from h2o_cli import bench_floor
    from h2o_cli.bench import SKIP_LLAMA_CPP

    monkeypatch.setattr(bench_floor, "llama_cpp_available", lambda: False)
    model, data = tiny_folders
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    context, chunk, decode = 64, 16, 4
    doc = tmp_path / "bench.md"
    code, report, err = run_bench(
        monkeypatch, capsys, "--only", "floor", "--model", str(model), "--data-dir", str(data),
        "--contexts", str(context), "--chunk", str(chunk), "--decode", str(decode), "--gguf", str(gguf),
        "--out", str(doc),
    )  # fmt: skip
    assert code == 0, err
    floor = report["floor"]
    sizes = tiny_config()
    hidden, inner, layers = sizes.hidden_size, sizes.intermediate_size, sizes.num_hidden_layers
    head = hidden // sizes.num_attention_heads
    kv = sizes.num_key_value_heads * head
    want = {(hidden, hidden): 2 * layers, (hidden, kv): 2 * layers, (hidden, inner): 2 * layers,
            (inner, hidden): layers, (hidden, sizes.vocab_size): 1}  # fmt: skip
    for shapes, rows, figures in (
        (floor["read_shapes"], chunk, floor["read_matmul"]),
        (floor["decode_shapes"], 1, floor["decode_matmul"]),
    ):
        assert {(s["in"], s["out"]): s["count"] for s in shapes} == want
        seconds = sum(s["count"] * s["seconds"] for s in shapes)
        flops = 2 * rows * sum(count * i * o for (i, o), count in want.items())
        assert figures["seconds"] == pytest.approx(seconds)
        assert figures["gflops"] == pytest.approx(flops / seconds / 1e9)
        assert figures["ceiling"] == pytest.approx(rows / seconds)
    budget = max(2, round(context * 0.1))
    weights = sum(count * i * o for (i, o), count in want.items()) + sizes.vocab_size * hidden  # + embeddings
    weights += (2 * layers + 1) * hidden  # the norms
    kv_bytes = layers * 2 * kv * 4  # K and V, fp32
    assert (floor["budget"], floor["context"], floor["chunk"], floor["tokens"]) == (
        budget,
        context,
        chunk,
        decode,
    )
    assert floor["bytes_per_token"] == 4 * weights + budget * kv_bytes
    assert floor["decode_bytes_ceiling"] == pytest.approx(floor["bandwidth"] / floor["bytes_per_token"])
    assert floor["llama_cpp"] is None and SKIP_LLAMA_CPP in report["notes"]
    assert all(floor[phase] > 0 for phase in ("read", "decode"))
    text = doc.read_text(encoding="utf-8")
    best = min(floor["decode_matmul"]["ceiling"], floor["decode_bytes_ceiling"])
    assert (
        f"| decode | {floor['decode']:,.1f} | {floor['decode_matmul']['ceiling']:,.1f} | "
        f"{floor['decode_bytes_ceiling']:,.1f} | {floor['decode'] / best:.2f} | not measured |  |"
    ) in text
    assert f"| read | {floor['read']:,.1f} | {floor['read_matmul']['ceiling']:,.1f} |  | " in text
    assert SKIP_LLAMA_CPP in text


def test_floor_and_llama_cpp_parts_put_llama_cpps_read_and_decode_beside_ours(
    tiny_folders, monkeypatch, capsys, tmp_path
):
    """With llama-cpp-python present (a stand-in here: nothing in these tests times llama.cpp itself), the
    context is read in one prompt evaluation in batches of `--chunk`, then `--decode` tokens one by one; the
    floor table and the llama_cpp rows divide our speeds by those."""
    import types

    from h2o_cli import bench_floor

    calls: list[list[int]] = []

    class Llama:
        def __init__(self, path, n_ctx, n_threads, n_batch, verbose):
            assert (n_ctx % 256, n_threads, n_batch) == (0, 1, 16)

        def tokenize(self, text: bytes) -> list[int]:
            return [7] * text.count(b" the")

        def eval(self, tokens) -> None:
            calls.append(list(tokens))
            time.sleep(0.001)

        def sample(self) -> int:
            return 5

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    monkeypatch.setattr(bench_floor, "llama_cpp_available", lambda: True)
    model, data = tiny_folders
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    context, decode = 64, 3
    code, report, err = run_bench(
        monkeypatch, capsys, "--only", "floor,llama_cpp", "--model", str(model), "--data-dir", str(data),
        "--contexts", str(context), "--chunk", "16", "--decode", str(decode), "--gguf", str(gguf),
        "--out", str(tmp_path / "bench.md"),
    )  # fmt: skip
    assert code == 0, err
    assert [len(call) for call in calls] == [context] + [1] * decode
    floor = report["floor"]
    llama = floor["llama_cpp"]
    rows = {row["what"]: row for row in report["rows"]}
    for phase in ("read", "decode"):
        row = rows[f"llama.cpp {phase} tok/s, context {context}"]
        assert row["value"] == llama[phase] and row["ratio_of"] == "ours (full) / llama.cpp"
        line = f"| {floor[phase]:,.1f} | "
        assert line in (tmp_path / "bench.md").read_text(encoding="utf-8")
        assert f"| {llama[phase]:,.1f} | {floor[phase] / llama[phase]:.2f} |" in (
            tmp_path / "bench.md"
        ).read_text(encoding="utf-8")


def test_the_read_ceiling_is_timed_in_the_dtype_reads_multiply_in():
    """Under `--dtype auto` a read's linears multiply in bf16 (`PhaseLinear`): its ceiling is timed in bf16,
    a decode step's (one row) in the weights' fp32; a model without the bf16 copy times both in fp32."""
    from h2o_cli.bench_floor import matmul_times
    from h2o_cli.models.precision import READ_ROWS, read_in_bf16

    plain = LlamaForCausalLM(tiny_config()).eval()
    assert {shape["dtype"] for shape in matmul_times(plain, READ_ROWS, repeats=1)} == {"float32"}
    model = read_in_bf16(LlamaForCausalLM(tiny_config()).eval())
    assert {shape["dtype"] for shape in matmul_times(model, READ_ROWS, repeats=1)} == {"bfloat16"}
    assert {shape["dtype"] for shape in matmul_times(model, 1, repeats=1)} == {"float32"}
