"""The `recall` archive's file (docs/spec.md, recall: storage): where it goes, that it never overwrites, that
it is removed at exit, after a kill (by the next run) and on termination unless kept, when `auto` puts it on
disk, and that a disk archive keeps the peak RSS flat."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO
from test_cli_stream import one_error_line

from h2o_cli.cache import H2OCache
from h2o_cli.cache.recall import limits
from h2o_cli.cache.recall.archive_folder import archive_location
from h2o_cli.cache.recall.limits import archive_storage
from h2o_cli.config import CacheSettings
from h2o_cli.errors import ArchiveError

MiB = 2**20


def test_an_unwritable_archive_path_is_one_error_naming_it_and_the_fix(tiny_pair, tmp_path):
    _, model = tiny_pair
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    where = f"{blocker}/archive.kv"
    with pytest.raises(ArchiveError) as caught:
        H2OCache(model, CacheSettings(budget=16, policy="recall", chunk=4, archive=where))
    message = str(caught.value)
    assert where in message and "--archive PATH" in message and "--archive ram" in message
    assert "\n" not in message and caught.value.exit_code == 1


def test_an_existing_file_is_never_overwritten(tiny_pair, tmp_path):
    _, model = tiny_pair
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(ArchiveError, match="notes.txt exists; the recall archive never overwrites a file"):
        H2OCache(model, CacheSettings(budget=16, policy="recall", chunk=4, archive=str(notes)))
    assert notes.read_text() == "keep me"


def test_archive_location_names_a_fresh_file_in_a_folder_or_the_given_file(tmp_path, monkeypatch):
    monkeypatch.setenv("H2O_HOME", str(tmp_path / "home"))
    disk = archive_location("disk")
    assert disk.parent == tmp_path / "home" / "archive" and disk.name.startswith(f"recall-{os.getpid()}-")
    assert archive_location(str(tmp_path)).parent == tmp_path  # an existing folder
    assert archive_location(f"{tmp_path}/new/").parent == tmp_path / "new"  # a folder to be made
    assert archive_location(str(tmp_path / "mine.kv")) == tmp_path / "mine.kv"
    assert archive_location("disk", keep=True).name.startswith("recall-kept-")


def test_a_killed_runs_archive_is_removed_by_the_next_one_in_its_folder(tiny_pair, tmp_path):
    _, model = tiny_pair
    stale = tmp_path / "recall-999999999-0123abcd.kv"  # no such process
    kept = tmp_path / "recall-kept-0123abcd.kv"
    for path in (stale, kept):
        path.write_bytes(b"x")
    cache = H2OCache(model, CacheSettings(budget=16, policy="recall", chunk=4, archive=str(tmp_path)))
    assert not stale.exists() and kept.exists()
    cache.close()


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from transformers import LlamaForCausalLM
    from conftest import tiny_config
    from h2o_cli.cache import H2OCache
    from h2o_cli.config import CacheSettings

    folder, how = sys.argv[1], sys.argv[2]
    model = LlamaForCausalLM(tiny_config()).eval()
    settings = CacheSettings(budget=16, policy="recall", chunk=4, archive=folder + "/", keep_archive=how == "keep")
    cache = H2OCache(model, settings)
    with torch.no_grad():
        model(torch.arange(40)[None], cache=cache)
    print(cache.archive_summary().archive_path, flush=True)
    if how == "exception":
        raise RuntimeError("boom")
    if how == "interrupt":
        raise KeyboardInterrupt
    """
)


@pytest.mark.heavy  # four fresh interpreters importing torch and transformers
def test_the_archive_file_is_removed_at_exit_unless_kept(tmp_path):
    """A normal end, an exception, Ctrl-C (KeyboardInterrupt) and --keep-archive, one process each (at once)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), str(REPO / "kernels")]),
    }
    ways = ("normal", "exception", "interrupt", "keep")
    for how in ways:
        (tmp_path / how).mkdir()
    runs = {
        how: subprocess.Popen(
            [sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / how), how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for how in ways
    }
    for how, run in runs.items():
        out, err = run.communicate(timeout=600)
        assert (run.returncode == 0) == (how in ("normal", "keep")), err
        path = out.strip()
        assert os.path.dirname(path) == str(tmp_path / how), err
        assert os.listdir(tmp_path / how) == ([os.path.basename(path)] if how == "keep" else []), how


def rss_probe(archive: str, env: dict) -> subprocess.Popen:
    """Peak RSS after 512 and 2,048 tokens, in a fresh process (tests/archive_rss_probe.py)."""
    probe = str(REPO / "tests" / "archive_rss_probe.py")
    return subprocess.Popen(
        [sys.executable, probe, archive, "512", "2048"], stdout=subprocess.PIPE, text=True, env=env
    )


@pytest.mark.heavy  # two fresh interpreters streaming 2,048 tokens through a wide model
def test_a_disk_archive_keeps_the_peak_rss_flat_where_a_ram_archive_grows(tmp_path):
    """1,536 more tokens of 64 KiB of K/V each: 96 MiB more archive. In RAM the peak RSS grows by about that;
    in a file (written through the page cache, mapped pages released after each read) it does not."""
    env = {**os.environ, "H2O_HOME": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "kernels")])
    runs = {archive: rss_probe(archive, env) for archive in ("ram", "disk")}  # at once: half the wait
    reports = {archive: json.loads(run.communicate(timeout=600)[0]) for archive, run in runs.items()}
    growth = {  # the peak: what the flat-RSS claim bounds
        archive: report["peak_rss_bytes"]["2048"] - report["peak_rss_bytes"]["512"]
        for archive, report in reports.items()
    }
    # What is resident now: a transient peak before 512 tokens (seen under load) cannot hide the RAM archive.
    resident = {
        archive: report["rss_bytes"]["2048"] - report["rss_bytes"]["512"]
        for archive, report in reports.items()
    }
    archive_growth = 1536 * 64 * 1024
    for report in reports.values():
        assert report["archive_token_bytes"] == 64 * 1024
        assert report["archive_tokens"] == 2048  # the cap (4,096) exceeds the stream
    assert resident["ram"] > 0.8 * archive_growth, resident
    assert growth["disk"] < 0.15 * archive_growth, growth
    assert resident["disk"] < 0.15 * archive_growth, resident
    assert reports["disk"]["archive_disk_bytes"] > archive_growth
    assert not os.listdir(tmp_path / "archive")


@pytest.mark.model
def test_stream_with_a_file_archive_as_a_user_runs_it(tmp_path):
    """`h2o stream` with an int8 archive in a folder: the same perplexity as in RAM, the file's figures in
    --json, the file kept with --keep-archive and gone without; an unwritable path is one error line, exit 1."""
    from test_cli_stream import EXCERPT, h2o

    args = ["--ppl", "--json", "--budget", "64", "--max-tokens", "300", "--chunk", "32", "--policy", "recall"]
    args += ["--archive-bits", "8", "--archive-max", "4MiB", "--page-size", "8", "--block-size", "8"]
    kept = h2o("stream", EXCERPT, *args, "--archive", f"{tmp_path}/", "--keep-archive")
    assert kept.returncode == 0, kept.stderr.decode()
    on_disk = json.loads(kept.stdout)
    path = on_disk["archive_path"]
    assert (
        on_disk["archive_storage"] == "disk"
        and on_disk["archive_kept"]
        and os.path.dirname(path) == str(tmp_path)
    )
    assert os.listdir(tmp_path) == [os.path.basename(path)]
    assert os.path.getsize(path) >= on_disk["archive_disk_bytes"] > 0
    # SmolLM2 int8: 30 layers x 3 KV heads x (K and V of 64 int8 + two fp32 scales) per token.
    assert on_disk["archive_token_bytes"] == 30 * 3 * (2 * 64 + 2 * 4)
    # 4 MiB / (8 tokens x (that + int64 index + fp32 min/max of 3 x 64 per 8 tokens) x 30 layers) = 28 pages:
    # 224 tokens; after 300 tokens the newest page starts at 296, so recall reaches back to 296 + 8 - 224 = 80.
    assert on_disk["archive_capacity"] == 224 and on_disk["archive_reach"] == 80
    assert on_disk["archive_bytes"] <= 4 * MiB
    os.unlink(path)
    removed = h2o("stream", EXCERPT, *args, "--archive", f"{tmp_path}/")
    assert removed.returncode == 0 and not os.listdir(tmp_path)
    in_ram = json.loads(h2o("stream", EXCERPT, *args).stdout)
    assert in_ram["archive_storage"] == "ram" and in_ram["ppl"] == on_disk["ppl"]
    assert in_ram["recall_hits"] == on_disk["recall_hits"] > 0
    (tmp_path / "a-file").write_text("not a folder")
    where = f"{tmp_path}/a-file/archive.kv"
    bad = h2o("stream", EXCERPT, *args, "--archive", where)
    assert bad.returncode == 1 and not bad.stdout
    line = one_error_line(bad.stderr.decode())
    assert where in line and "--archive PATH" in line


@pytest.mark.parametrize(
    ("setting", "stored", "device", "want"),
    [
        ("auto", 2**30, "cpu", "ram"),  # below the limit on any machine of 8 GiB or more
        ("auto", 2**40, "cpu", "disk"),
        ("auto", 2**40, "cuda", "ram"),
        ("ram", 2**40, "cpu", "ram"),
        ("disk", 1, "cpu", "disk"),
        ("/some/folder/", 1, "cpu", "/some/folder/"),
    ],
)
def test_auto_keeps_a_small_archive_in_ram_and_a_large_one_on_disk(setting, stored, device, want):
    assert archive_storage(setting, stored, device) == want


def test_the_default_archive_goes_to_a_file_past_the_ram_limit(tiny_pair, monkeypatch, tmp_path):
    """`--archive auto` (the default) with every layer's K/V above `AUTO_RAM_BYTES`: a file in
    $H2O_HOME/archive/, removed when the cache closes; below it, RAM."""
    _, model = tiny_pair
    monkeypatch.setenv("H2O_HOME", str(tmp_path))
    settings = CacheSettings(budget=24, policy="recall", chunk=4, archive_max=256)
    assert settings.archive == "auto" and CacheSettings(budget=24).archive_max == limits.DEFAULT_ARCHIVE_MAX
    small = H2OCache(model, settings)
    assert small.archive_summary().archive_storage == "ram"
    monkeypatch.setattr(limits, "AUTO_RAM_BYTES", 1024)
    large = H2OCache(model, settings)
    summary = large.archive_summary()
    assert summary.archive_storage == "disk"
    assert os.path.dirname(summary.archive_path) == str(tmp_path / "archive")
    large.close()
    assert not os.path.exists(summary.archive_path)


@pytest.mark.model
@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_terminated_stream_removes_its_archive_file(tmp_path, number):
    """SIGTERM (`kill`, `timeout`) or SIGHUP (the terminal closed) mid-stream: exit code 128 + the signal's
    number and the recall archive's file removed, as after Ctrl-C or an error."""
    code = "from h2o_cli.cli.app import main; main()"
    args = ["stream", "--sample", "--ppl", "--policy", "recall", "--budget", "64", "--chunk", "16"]
    args += ["--max-tokens", "20000", "--archive", f"{tmp_path}/", "--threads", "1"]
    run = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # a terminal's child, not nohup's
    )
    deadline = time.monotonic() + 120
    while not os.listdir(tmp_path) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert os.listdir(tmp_path), "the archive file never appeared"
    time.sleep(1.0)  # inside the read
    run.send_signal(number)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 128 + number, err.decode()
    assert not os.listdir(tmp_path)


def test_auto_keeps_at_most_an_eighth_of_the_machines_memory_in_ram(monkeypatch):
    """`--archive auto` on the CPU: RAM up to `AUTO_RAM_BYTES` of K/V, or an eighth of the physical memory
    where that is less; a platform that cannot say its memory takes the limit alone."""
    page = 4096
    for memory, limit in ((64 * 2**30, limits.AUTO_RAM_BYTES), (8 * 2**30, 2**30)):
        monkeypatch.setattr(
            os, "sysconf", lambda name, memory=memory: page if name == "SC_PAGE_SIZE" else memory // page
        )
        assert limits.auto_ram_bytes() == limit
        assert limits.archive_storage("auto", limit, "cpu") == "ram"
        assert limits.archive_storage("auto", limit + 1, "cpu") == "disk"
        assert limits.archive_storage("auto", limit + 1, "cuda") == "ram"
        assert limits.archive_storage("disk", 1, "cpu") == "disk"

    def unknown(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", unknown)
    assert limits.auto_ram_bytes() == limits.AUTO_RAM_BYTES


def _vm_flags(address: int) -> set[str]:
    """The kernel's flags of the mapping holding `address` (/proc/self/smaps `VmFlags`)."""
    current = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(part, 16) for part in first.split("-"))
                current = start <= address < end
            elif current and first == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_an_archive_file_is_mapped_for_random_reads(tmp_path):
    """The page choice reads scattered 4 KiB pages of the mapping: `MADV_RANDOM` (VmFlags `rr`) keeps a fault
    past the page cache from reading the readahead window around its page, on the file's own mapping and on a
    saved file's adopted over it."""
    from h2o_cli.cache.recall.archive_file import ArchiveFile

    file = ArchiveFile(tmp_path / "archive.kv", 1 << 20)
    assert "rr" in _vm_flags(file.base)
    saved = tmp_path / "saved.kv"
    saved.write_bytes(bytes(1 << 20))
    descriptor = os.open(saved, os.O_RDONLY)
    try:
        assert file.adopt(descriptor)
        assert "rr" in _vm_flags(file.base)
    finally:
        os.close(descriptor)
    file.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_question_reads_its_layer_in_order_and_a_chunk_at_random(tmp_path, monkeypatch):
    """A question scores every archived page, reading the layer's keys in order: the region reads ahead while
    it does (VmFlags `sr`: past the page cache 6x faster than page by page) and at random again after; a
    chunk's choice over a shortlist reads at random throughout (`rr`)."""
    import torch
    from test_archive_reach import HEAD_DIM, PAGE, file_archive, write_text

    from h2o_cli.cache.recall.archive import PageSettings
    from h2o_cli.cache.recall.archive_file import ArchiveRegion

    shortlisted = PageSettings(PAGE, attention=True, shortlist=4, carry=0.9, chunk_weight=8.0)
    archive, file = file_archive(tmp_path, 64 * PAGE, settings=shortlisted)
    write_text(archive, torch.randn(1, 48 * PAGE, HEAD_DIM))
    seen, release = [], ArchiveRegion.release
    monkeypatch.setattr(
        ArchiveRegion, "release", lambda self: (seen.append(_vm_flags(file.base)), release(self))
    )
    query, empty = torch.randn(1, 2, HEAD_DIM), torch.full((1, 1), -1)
    archive.choose(query, empty, 48 * PAGE, PAGE, chunk=2)  # a chunk of text: the shortlist's pages
    assert seen and all("rr" in flags and "sr" not in flags for flags in seen)
    seen.clear()
    archive.choose(query, empty, 48 * PAGE, PAGE, question=True)  # a question: every page
    assert any("sr" in flags for flags in seen)
    assert "rr" in _vm_flags(file.base) and "sr" not in _vm_flags(file.base)
    file.close()


def test_an_archive_file_goes_with_its_cache_without_a_garbage_collection(tiny_pair, monkeypatch, tmp_path):
    """A run of many caches (an eval's examples, a grid's runs) must not keep each one's file until Python's
    cycle collector runs: the last reference to a cache removes its file (a 32K RULER document's is 1.8 GB)."""
    import gc

    import torch

    from h2o_cli.cache import H2OCache

    _, model = tiny_pair
    monkeypatch.setenv("H2O_HOME", str(tmp_path))
    gc.disable()
    try:
        cache = H2OCache(model, CacheSettings(budget=24, policy="recall", chunk=8, archive="disk"), span=200)
        with torch.no_grad():
            model(torch.randint(0, 100, (1, 64)), past_key_values=cache, use_cache=True)
        path = cache.archive_file.path
        assert path.exists()
        del cache
        assert not path.exists()
    finally:
        gc.enable()
