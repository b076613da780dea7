"""Where the `recall` archive lives (docs/spec.md, recall: storage): RAM or a memory-mapped file, float or int8,
capped in tokens or bytes, and what it reports (its file: test_archive_file.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import run_stream
from test_cli_stream import h2o_in_process, one_error_line
from typer.testing import CliRunner

from h2o_cli import memory
from h2o_cli.cache import H2OCache
from h2o_cli.cache.kvquant import dequantize, quantize
from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.cache.recall.limits import archive_cap
from h2o_cli.cli.app import app
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError

MiB = 2**20


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (16384, (16384, "tokens")),
        ("16384", (16384, "tokens")),
        ("64MiB", (64 * MiB, "bytes")),
        ("1GiB", (2**30, "bytes")),
        ("1.5GiB", (3 * 2**29, "bytes")),
        ("500MB", (500_000_000, "bytes")),
        ("4096B", (4096, "bytes")),
        ("2 kib", (2048, "bytes")),
    ],
)
def test_archive_max_takes_tokens_or_bytes(value, want):
    assert archive_cap(value) == want


@pytest.mark.parametrize("value", ["16k", "-5", "MiB", "1.2", "", "64 MiBs", "0x10"])
def test_a_bad_archive_max_is_one_usage_error(value, monkeypatch, capsys):
    with pytest.raises(UsageError, match=r"--archive-max .* is neither a token count .* nor a size"):
        CacheSettings(budget=64, policy="recall", archive_max=value)
    code, out, err = h2o_in_process(monkeypatch, capsys, "memory", "--archive-max", value)
    assert code == 2 and not out
    assert one_error_line(err).startswith("h2o: error: --archive-max")


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("bits", [None, 8])
def test_a_file_archive_recalls_bit_for_bit_what_the_ram_archive_does(
    tiny_pair, tmp_path, bits, chunk, kernels
):
    """On either step: under `auto` a float32 archive's one-token steps are C calls, in RAM and in a file alike
    (the torch step rounds otherwise; tests/test_native_recall.py compares the two)."""
    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(8))
    base = dict(budget=24, policy="recall", chunk=chunk, page_size=4, archive_max=64, archive_bits=bits)
    base["kernels"] = kernels
    want, ram = run_stream(model, CacheSettings(**base), ids, chunk)
    got, disk = run_stream(model, CacheSettings(**base, archive=f"{tmp_path}/"), ids, chunk)
    assert torch.equal(got, want)
    on_disk, in_ram = disk.archive_summary(), ram.archive_summary()
    path = on_disk.archive_path
    assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) >= on_disk.archive_disk_bytes
    assert in_ram.archive_storage == "ram" and in_ram.archive_disk_bytes == 0
    assert on_disk.archive_storage == "disk" and on_disk.archive_bytes == in_ram.archive_bytes
    # The file holds the K/V (and scales) and the page summaries (min and max per block of 4, fp32); the token
    # index stays in RAM.
    layers, shape = len(disk.layers), disk.shape
    kv = 64 * shape.n_kv_heads * memory.token_kv_bytes(shape, bits, 4)
    summaries = 64 // 4 * shape.n_kv_heads * 2 * shape.head_dim * 4
    assert on_disk.archive_disk_bytes == layers * (kv + summaries)
    assert (
        on_disk.archive_ram_bytes == in_ram.archive_ram_bytes - layers * (kv + summaries) == layers * 64 * 8
    )
    for key in ("archive_reach", "archive_tokens", "recalled_per_step", "recall_hits"):
        assert getattr(on_disk, key) == getattr(in_ram, key)
    assert on_disk.archive_reach == 150 - 62 and on_disk.recalled_per_step > 0
    disk.close()
    assert not os.listdir(tmp_path)


def test_recall_hits_are_tokens_kept_in_the_recall_slots_from_one_step_to_the_next(tiny_pair):
    """Counted by hand from the slots before and after each step: hits are the chosen tokens already there."""
    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(9))
    cache = H2OCache(model, CacheSettings(budget=16, policy="recall", chunk=1, page_size=2, archive_max=64))
    layer, counted = cache.layers[1], []
    with torch.no_grad():
        for step in range(80):
            before = [set(row.tolist()) - {-1} for row in layer.recall_index]
            model(ids[:, step : step + 1], cache=cache)
            after = [set(row.tolist()) - {-1} for row in layer.recall_index]
            counted.append(sum(len(a & b) for a, b in zip(after, before, strict=True)) / len(after))
            assert layer.hits == counted[-1]
    assert layer.hits_total == pytest.approx(sum(counted)) and 0 < sum(counted) < layer.recalled_total
    summary = cache.archive_summary()
    assert summary.archive_reads_per_step == pytest.approx(summary.recalled_per_step - summary.recall_hits)


def test_int8_archive_summaries_are_the_exact_keys_so_the_pages_chosen_are_the_same():
    """The page choice reads only the summaries, token indices and queries: with summaries from the exact keys
    an int8 archive must choose exactly what the float archive chooses, although its stored keys differ."""
    torch.manual_seed(10)
    n_kv, d, size = 2, 16, 4
    keys = torch.randn(n_kv, 70, d) * torch.logspace(-2, 1, d)  # channels of very different ranges
    values = torch.randn(n_kv, 70, d)
    archives = [
        PageArchive(n_kv, d, 64, PageSettings(size), torch.float32, torch.device("cpu"), bits)
        for bits in (None, 8)
    ]
    for archive in archives:
        archive.write(keys[:, :33], values[:, :33])
        archive.write(keys[:, 33:], values[:, 33:])
    exact, rounded = archives
    assert torch.equal(exact.low, rounded.low) and torch.equal(exact.high, rounded.high)
    stored = dequantize(rounded.keys, rounded.key_scales, torch.float32)
    pages = stored.view(n_kv, 16, size, d)
    assert not torch.equal(pages.amax(dim=2), rounded.high), "int8 keys would have given other summaries"
    queries = torch.randn(n_kv, 3, d)
    resident = torch.tensor([[60, 61, 62, -1], [10, 40, 41, 69]])
    for slots in (5, 30):
        chosen = [archive.choose(queries, resident, before=66, slots=slots) for archive in archives]
        assert torch.equal(chosen[0][0], chosen[1][0]) and torch.equal(chosen[0][1], chosen[1][1])
    # What comes back is the int8 round trip of the token's K/V (kvquant's rule).
    heads, slots = torch.tensor([0, 1, 1]), torch.tensor([3, 20, 63])
    read_keys, read_values = rounded.read(heads, slots)
    tokens = rounded.token_index[slots]
    codes, scales = quantize(keys[heads, tokens].unsqueeze(0))
    torch.testing.assert_close(read_keys, dequantize(codes, scales, torch.float32)[0], rtol=0, atol=0)
    assert float((read_values - values[heads, tokens]).abs().max()) <= float(values.abs().max()) / 254 + 1e-6


@pytest.mark.parametrize("chunk", [1, 7])
def test_an_int8_archive_errs_no_more_than_an_int8_kv_cache(tiny_pair, chunk):
    """Tolerance: where every evicted token is recalled (the `full` anchor), the int8 archive's logits differ
    from plain transformers by at most twice what a full int8 K/V cache (`--kv-bits 8`) differs, + 1e-5."""
    reference, model = tiny_pair
    ids = torch.randint(0, 128, (1, 61), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(ids).logits
    recall = CacheSettings(budget=64, policy="recall", chunk=chunk, page_size=4, archive_bits=8)
    got, cache = run_stream(model, recall, ids, chunk)
    int8_kv, _ = run_stream(
        model, CacheSettings(budget=64, policy="full", chunk=chunk, kv_bits=8), ids, chunk
    )
    int8_error = float((int8_kv - want).abs().max())
    assert float((got - want).abs().max()) <= 2 * int8_error + 1e-5
    assert cache.archive_summary().recalled_per_step > 0 and int8_error > 0


def test_a_cap_in_bytes_holds_the_whole_pages_that_fit(tiny_pair):
    _, model = tiny_pair
    shape = memory.ModelShape.from_config(model.config)
    for bits in (None, 8):
        # By hand: 2 layers x (2 KV heads x (K and V of 16 dims) + int64 index + fp32 min/max per 8-token page).
        per_token = {None: 2 * 16 * 4, 8: 2 * 16 + 2 * 4}[bits]
        page_bytes = 8 * 2 * (2 * per_token + 8 + 2 * 16 * 2 * 4 / 8)
        settings = CacheSettings(
            budget=16,
            policy="recall",
            chunk=4,
            page_size=8,
            block_size=8,
            archive_max="40KiB",
            archive_bits=bits,
        )
        cache = H2OCache(model, settings)
        summary = cache.archive_summary()
        assert summary.archive_capacity == 40 * 1024 // page_bytes * 8
        assert summary.archive_bytes <= 40 * 1024 < summary.archive_bytes + page_bytes
        assert summary.archive_bytes == memory.archive_bytes(shape, summary.archive_capacity, 8, 4, bits)
    with pytest.raises(UsageError, match="--archive-max 2KiB holds fewer than two pages of 8 tokens"):
        H2OCache(model, CacheSettings(budget=16, policy="recall", chunk=4, page_size=8, archive_max="2KiB"))


def test_memory_accounts_the_archive_per_token_for_each_storage():
    """llama-7b fp16, by hand: 32 layers x 32 KV heads x 128 dims."""
    args = [
        "memory",
        "--model",
        "llama-7b",
        "--dtype",
        "float16",
        "--json",
        "--page-size",
        "8",
        "--block-size",
        "8",
    ]
    result = CliRunner().invoke(
        app, [*args, "--archive", "disk", "--archive-bits", "8", "--archive-max", "64MiB"]
    )
    assert result.exit_code == 0, result.output
    table = json.loads(result.stdout)
    index, summaries = 32 * 8, 32 * 32 * 128 * 2 * 4 / 8  # per token: int64 index, fp32 min/max per page
    float_kv, int8_kv = 32 * 32 * 2 * 128 * 2, 32 * 32 * (2 * 128 + 2 * 4)  # int8: + fp32 scales of K and V
    assert table["recall_archive_bytes_per_token_by_bits"] == {
        "model": float_kv + index + summaries,
        "16": float_kv + index + summaries,
        "8": int8_kv + index + summaries,
    }
    assert table["recall_archive_ram_bytes_per_token"] == index
    assert table["recall_archive_disk_bytes_per_token"] == int8_kv + summaries
    page_bytes = 8 * (int8_kv + index + summaries)
    tokens = 64 * MiB // page_bytes * 8
    assert table["recall_archive_tokens"] == tokens == 160
    assert table["recall_archive_disk_bytes"] == tokens * (int8_kv + summaries)
    assert table["recall_archive_ram_bytes"] == tokens * index
    ram = json.loads(CliRunner().invoke(app, [*args, "--archive", "ram", "--archive-max", "16384"]).stdout)
    assert ram["recall_archive_disk_bytes"] == 0 and ram["recall_archive_tokens"] == 16384
    assert ram["recall_archive_ram_bytes"] == 16384 * (float_kv + index + summaries)
    # The default: a reach of 1,048,576 tokens, whose K/V (512 GiB here) pass 1 GiB, so `auto` puts them and
    # the summaries in a file; RAM keeps the token index only.
    default = json.loads(CliRunner().invoke(app, args).stdout)
    assert default["recall_archive_tokens"] == 1_048_576
    assert default["recall_archive_disk_bytes"] == 1_048_576 * (float_kv + summaries)
    assert default["recall_archive_ram_bytes"] == 1_048_576 * index


def test_compare_rows_report_the_archive(tiny_pair, tmp_path):
    from h2o_cli.eval.compare import compare_perplexity

    _, model = tiny_pair
    settings = CacheSettings(budget=1.0, chunk=8, archive_bits=8, archive=str(tmp_path))
    rows = compare_perplexity(model, list(range(3, 90)), [0.5], ["h2o", "recall"], settings)
    assert "archive_bytes" not in rows[0]
    assert rows[1]["archive_storage"] == "disk" and rows[1]["archive_bits"] == 8
    assert rows[1]["archive_disk_bytes"] > 0 and rows[1]["recalled_per_step"] > 0
    assert rows[1]["archive_path"].startswith(str(tmp_path)) and not os.listdir(tmp_path)  # closed


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_the_page_choice_reports_the_keys_it_holds(tiny_pair, kernels):
    """`choice_bytes` counts the shortlist's keys that answer steps hold (torch or C step), and `h2o memory`'s
    prediction of it counts them and all but the C step's scratch sized by S and the recall slots."""
    _, model = tiny_pair
    shortlist, page, capacity = 12, 4, 128
    settings = CacheSettings(
        budget=24, policy="recall", chunk=1, page_size=page, archive_max=capacity, shortlist=shortlist,
        kernels=kernels,
    )  # fmt: skip
    cache = H2OCache(model, settings)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(3))
    before = cache.archive_summary().choice_bytes
    with torch.no_grad():
        for step in range(100):
            model(ids[:, step : step + 1], cache=cache)
    after = cache.archive_summary().choice_bytes
    shape = cache.shape
    held = len(cache.layers) * shape.n_kv_heads * shortlist * page * shape.head_dim * 2  # float16 keys
    assert after - before >= held
    predicted = memory.choice_bytes(shape, capacity, page, shortlist)
    assert before + held <= predicted
    if cache.layers[0].__dict__.get("_c_buffers") is not None:  # the C step ran: its scratch is counted too
        assert predicted <= after
