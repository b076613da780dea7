"""A saved read under faults: SIGKILL during a save, a full disk, a second writer, a mismatched resume. Each
is refused in one line (exit 1, 2 for usage) and leaves the previous save whole."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from test_cli_stream import h2o_in_process

import h2o_cli.saved as saved_module
from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.errors import H2OError
from h2o_cli.saved import model_identity, open_saved, write_saved
from h2o_cli.saved_checks import SaveLock, resume_settings
from h2o_cli.streaming import prefill

SETTINGS = CacheSettings(budget=32, policy="recall", chunk=8, page_size=4, recall_lead="none")


@pytest.fixture(scope="module")
def tiny():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_config()).eval()


def read(model, count: int, extra: dict | None = None, path: Path | None = None) -> H2OCache:
    cache = H2OCache(model, SETTINGS)
    ids = torch.randint(3, 128, (count,), generator=torch.Generator().manual_seed(count)).tolist()
    prefill(model, cache, [ids], 8)[1].reraise()
    if path is not None:
        write_saved(path, cache, model_identity(model, "tiny"), extra or {})
    return cache


def files(folder: Path) -> dict:
    return {path.relative_to(folder): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


@pytest.mark.slow  # a second interpreter loads torch and transformers
def test_a_save_killed_midway_leaves_the_previous_save_whole(tmp_path):
    """A process saves once, then is killed (SIGKILL) while its second save is being written: the first
    save opens and loads as it was written; the next save removes what the killed one left."""
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch, transformers
        import h2o_cli.saved as saved
        from conftest import tiny_config
        from test_saved_faults import read
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(tiny_config()).eval()
        read(model, 40, path={str(tmp_path / "read")!r})
        write = saved.write_all
        def slow(descriptor, data):
            print("writing", flush=True)
            time.sleep(0.2)
            write(descriptor, data)
        saved.write_all = slow
        read(model, 60, path={str(tmp_path / "read")!r})
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "writing\n"  # the second save has begun writing
        time.sleep(0.5)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    left = [path.name for path in tmp_path.iterdir() if ".tmp-" in path.name]
    assert left, "the killed save left its unfinished folder (and only that)"
    saved = open_saved(tmp_path / "read")
    assert saved.extra == {} and saved.manifest["counters"]["layers"][0]["store"]["tokens_seen"] == 40
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config()).eval()
    cache = H2OCache(model, resume_settings(saved, {}))
    saved.load_into(cache)  # every checksum holds
    assert cache.tokens_seen == 40
    read(model, 50, path=tmp_path / "read")
    assert not [path for path in tmp_path.iterdir() if ".tmp-" in path.name]


def test_a_disk_found_full_while_writing_keeps_the_previous_save(tiny, tmp_path, monkeypatch):
    read(tiny, 40, path=tmp_path / "read")
    before = files(tmp_path / "read")
    calls = []

    def full(descriptor, data):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.write(descriptor, data)

    monkeypatch.setattr(saved_module, "write_all", full)
    with pytest.raises(
        H2OError, match=r"cannot write the save .*No space left.*previous save there is whole"
    ):
        read(tiny, 60, path=tmp_path / "read")
    assert files(tmp_path / "read") == before
    assert sorted(path.name for path in tmp_path.iterdir()) == [".read.lock", "read"] or sorted(
        path.name for path in tmp_path.iterdir()
    ) == ["read"]


def test_a_save_that_does_not_fit_is_refused_before_writing(tiny, tmp_path, monkeypatch):
    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(saved_module.os, "statvfs", lambda path: Full())
    with pytest.raises(H2OError, match=r"the save needs [\d,]+ bytes in .* which has 40,960 free; nothing"):
        read(tiny, 40, path=tmp_path / "read")
    assert list(tmp_path.iterdir()) == []


def test_a_second_writer_is_refused_and_readers_are_not(tiny, tmp_path):
    read(tiny, 40, path=tmp_path / "read")
    first = SaveLock(tmp_path / "read")
    with pytest.raises(H2OError, match=rf"open for writing by another h2o \(pid {os.getpid()}\)"):
        SaveLock(tmp_path / "read")
    assert open_saved(tmp_path / "read").extra == {}  # a reader takes no lock
    first.release()
    SaveLock(tmp_path / "read").release()
    assert oct(os.stat(tmp_path / ".read.lock").st_mode & 0o777) == "0o600"


def test_the_commands_refuse_in_one_line(tiny, tmp_path, monkeypatch, capsys):
    """Each refusal comes before a model loads: exit 1 (2 for a usage error) and one line on stderr."""
    from test_cli_stream import one_error_line

    read(tiny, 40, {"kind": "text", "tokens": 40}, tmp_path / "text")
    read(tiny, 40, {"kind": "chat", "system": None, "turns": [], "ids": []}, tmp_path / "chat")
    save = str(tmp_path / "text")
    cases = [
        (("stream", "--resume", save, "--prompt", "q", "--budget", "64"), 1, "made with --budget 32, not 64"),
        (("stream", "--resume", save, "--prompt", "q", "--policy", "h2o"), 1, "made with --policy recall"),
        (("stream", "--resume", save), 2, "give it with --prompt"),
        (("stream", "book.txt", "--resume", save, "--prompt", "q"), 2, "give no FILE"),
        (("stream", "--resume", str(tmp_path / "none"), "--prompt", "q"), 1, "not a saved read"),
        (("stream", "--resume", str(tmp_path / "chat"), "--prompt", "q"), 1, "a saved chat, not a read text"),
        (("stream", "--sample", "--ppl", "--save", save), 2, "does not take --ppl"),
        (("chat", "--resume", save), 1, "a read text, not a chat"),
        (("chat", "--resume", str(tmp_path / "chat"), "--budget", "16"), 1, "made with --budget 32, not 16"),
    ]
    for args, code, message in cases:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello")))  # a piped message
        got, _, err = h2o_in_process(monkeypatch, capsys, *args)
        assert got == code and message in one_error_line(err), (args, err)
    lock = SaveLock(tmp_path / "chat")
    try:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello")))
        got, _, err = h2o_in_process(monkeypatch, capsys, "chat", "--resume", str(tmp_path / "chat"))
        assert got == 1 and "open for writing by another h2o" in one_error_line(err)
    finally:
        lock.release()
    manifest = json.loads((tmp_path / "text" / "manifest.json").read_text())
    assert manifest["version"] == saved_module.VERSION and manifest["model"]["name"] == "tiny"
