"""What h2o keeps on disk stays whole and its own: the C library it loads (refused when another user could
have planted it), transcripts (written aside then renamed, one name per chat), the recall archive (a private
folder, a full disk one line; its removal on SIGHUP is in test_archive_storage.py), and the C step's buffers
whatever torch's default dtype."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import feed_torch_and_c
from h2o_kernels import native

from h2o_cli.cache.recall.archive_file import ArchiveFile
from h2o_cli.cache.recall.archive_folder import archive_location
from h2o_cli.errors import ArchiveError, H2OError
from h2o_cli.private import write_private

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
CACHED = (native.library, native.available, native.has_step_scores)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def kernels_home(monkeypatch, tmp_path):
    """An empty `$H2O_HOME`, and the loaded library forgotten before and after (the next test loads its own)."""
    monkeypatch.setenv("H2O_HOME", str(tmp_path / "home"))
    for cached in CACHED:
        cached.cache_clear()
    yield tmp_path / "home" / "kernels"
    for cached in CACHED:
        cached.cache_clear()


def plant(monkeypatch, tmp_path: Path, marker: Path) -> None:
    """Make the compiler `native.build` runs build a library whose loading creates `marker` (code run by
    `dlopen`, as a planted library's would be)."""
    source = tmp_path / "planted.c"
    source.write_text(
        "#include <stdio.h>\n"
        f'__attribute__((constructor)) static void planted(void) {{ fclose(fopen("{marker}", "w")); }}\n'
    )
    run = subprocess.run

    def compile_planted(args, **options):
        if "-o" not in args:  # not the build (`platform.processor` runs `uname`)
            return run(args, **options)
        return run(
            [native.compiler(), "-shared", "-fPIC", str(source), "-o", args[args.index("-o") + 1]], **options
        )

    monkeypatch.setattr(native.subprocess, "run", compile_planted)


# The C library in $H2O_HOME/kernels/.


@needs_compiler
def test_a_group_writable_library_is_refused_in_one_line_and_the_torch_step_runs(
    kernels_home, monkeypatch, tmp_path, caplog
):
    """A library in the kernels folder that others could have written is never loaded (its code would run
    in every CPU run): one warning line names it and the fix, even under `--kernels auto`, and the C step
    is unavailable (the torch step runs). The folder, left 0755 by an older version, becomes 0700."""
    marker = tmp_path / "planted-code-ran"
    plant(monkeypatch, tmp_path, marker)
    with umask(0o022):
        kernels_home.mkdir(parents=True)
        library = native.build()
    os.chmod(library, 0o775)  # group-writable: another user of the group could have replaced it
    with caplog.at_level(logging.INFO, logger="h2o_kernels"):
        assert not native.available()
    assert not marker.exists(), "the planted library was loaded"
    lines = [record.getMessage() for record in caplog.records if record.name == "h2o_kernels"]
    assert len(lines) == 1 and caplog.records[-1].levelno == logging.WARNING
    assert str(library) in lines[0] and "writable" in lines[0] and "remove" in lines[0]
    assert mode(kernels_home) == 0o700


@needs_compiler
def test_the_kernels_folder_is_made_0700_and_the_library_only_its_owners(kernels_home, monkeypatch, tmp_path):
    """Under a group-friendly umask (002) the folder is still 0700 and the library built is writable by its
    owner alone (so h2o never refuses its own build)."""
    plant(monkeypatch, tmp_path, tmp_path / "marker")
    with umask(0o002):
        library = native.build()
    assert mode(kernels_home) == 0o700
    assert mode(library) & 0o022 == 0 and os.stat(library).st_uid == os.geteuid()


# Transcripts.


def test_a_full_disk_leaves_the_last_good_transcript_whole(tmp_path, monkeypatch):
    """ENOSPC part-way through a rewrite: one error naming the file, the previous transcript unchanged (0600),
    and no partial file left beside it."""
    path = tmp_path / "chats" / "chat.json"
    good = "a good transcript\n" * 2000
    write_private(path, good)
    write = os.write

    def full_disk(descriptor, data):
        write(descriptor, bytes(data[:100]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(H2OError) as failed:
        write_private(path, "the next one\n" * 2000)
    message = str(failed.value)
    assert str(path) in message and "No space left" in message and "\n" not in message
    assert path.read_text() == good and mode(path) == 0o600
    assert os.listdir(path.parent) == ["chat.json"]


def test_a_second_ctrl_c_during_the_save_leaves_the_last_good_transcript_whole(tmp_path, monkeypatch):
    path = tmp_path / "chat.md"
    write_private(path, "before\n")

    def interrupted(descriptor, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_private(path, "after\n")
    assert path.read_text() == "before\n" and os.listdir(tmp_path) == ["chat.md"]


def test_short_writes_are_carried_on_and_the_transcript_reaches_the_disk(tmp_path, monkeypatch):
    """A write that takes only part of the bytes is followed by the rest; the file is synced before the
    rename (a crash after it finds the new text, not an empty file)."""
    write, synced = os.write, []
    monkeypatch.setattr(os, "write", lambda descriptor, data: write(descriptor, bytes(data[:7])))
    monkeypatch.setattr(os, "fsync", synced.append)
    text = "ünïcode and a long line " * 300
    path = write_private(tmp_path / "chat.json", text)
    assert path.read_text(encoding="utf-8") == text and mode(path) == 0o600 and synced


def test_two_chats_started_in_the_same_second_keep_two_transcripts(tmp_path, monkeypatch):
    """Two chats (in one process or two) started in the same second write two transcripts, and each chat
    keeps rewriting its own."""
    from h2o_cli.cli import chat_repl

    monkeypatch.setenv("H2O_HOME", str(tmp_path))
    second = time.localtime()
    strftime = time.strftime
    monkeypatch.setattr(chat_repl.time, "strftime", lambda form, *when: strftime(form, second))

    class Session:  # what the loop asks of a chat session to save it
        def __init__(self, text: str) -> None:
            self.turns, self.text = [text], text

        def save(self, path):
            return write_private(path, self.text)

    sessions = [Session("first chat"), Session("second chat")]
    loops = [
        chat_repl.ChatLoop(session, False, "tiny", reader=chat_repl.LineReader()) for session in sessions
    ]
    for loop in loops:
        loop._save_transcript()
    sessions[0].text = "first chat, a turn later"
    loops[0]._save_transcript()
    saved = sorted((tmp_path / "chats").glob("chat-*.json"))
    assert len(saved) == 2
    assert {path.read_text() for path in saved} == {"first chat, a turn later", "second chat"}
    assert all(mode(path) == 0o600 for path in saved)


# The recall archive's folder and file.


def test_the_archive_folder_is_private(tmp_path, monkeypatch):
    """`--archive disk`'s folder is 0700 whatever the umask, also when an older version made it 0755."""
    monkeypatch.setenv("H2O_HOME", str(tmp_path))
    with umask(0o022):
        archive = ArchiveFile(archive_location("disk"), 4096)
    assert mode(tmp_path / "archive") == 0o700 and mode(archive.path) == 0o600
    archive.close()
    os.chmod(tmp_path / "archive", 0o755)
    ArchiveFile(archive_location("disk"), 4096).close()
    assert mode(tmp_path / "archive") == 0o700


def test_a_junk_pid_in_a_file_name_is_skipped_by_the_stale_sweep(tmp_path):
    """Files named as the archive names its own but with a PID no process can have (0, past 2**31) are
    left alone: the sweep neither crashes nor signals process group 0."""
    junk = [tmp_path / "recall-99999999999-deadbeef.kv", tmp_path / "recall-0-deadbeef.kv"]
    for path in junk:
        path.write_bytes(b"")
    ArchiveFile(tmp_path / "archive.kv", 4096).close()
    assert all(path.exists() for path in junk)


def no_fallocate(descriptor, offset, length):
    raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))


class Space:
    """`os.statvfs`'s answer for a file system with `free` bytes left."""

    def __init__(self, free: int) -> None:
        self.f_bavail, self.f_frsize, self.f_bsize = free // 4096, 4096, 4096


def test_without_a_real_reservation_a_stretch_that_does_not_fit_is_refused_before_writing(
    tmp_path, monkeypatch
):
    """Where `posix_fallocate` is unsupported the file stays sparse and the C step's writes through the
    mapping would end the process with SIGBUS on a full disk: each stretch the archive reserves ahead of its
    writes has its free space checked first, and a lack of it is one line naming the folder and the fix; the
    file (sparse, sized for the whole reach) is removed when closed."""
    folder = tmp_path / "archives"
    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    monkeypatch.setattr(os, "statvfs", lambda path: Space(1 << 20))
    archive = ArchiveFile(folder / "archive.kv", 8 << 20)
    assert os.path.getsize(archive.path) == 8 << 20
    archive.reserve(0, 512 << 10)  # a stretch that fits
    with pytest.raises(ArchiveError) as refused:
        archive.reserve(512 << 10, 4 << 20)
    message = str(refused.value)
    assert str(folder) in message and "--archive ram" in message and "\n" not in message
    archive.close()
    assert os.listdir(folder) == []


def region_of(tmp_path: Path):
    file = ArchiveFile(tmp_path / "archive.kv", 4096)
    region = file.region(4096)
    return file, region, region.take((2, 8, 4), torch.float32)


def test_short_pwrites_are_carried_on(tmp_path, monkeypatch):
    """The torch path's archive write (`os.pwrite`) goes on after a partial write: every byte arrives."""
    file, region, target = region_of(tmp_path)
    pwrite = os.pwrite
    monkeypatch.setattr(
        os, "pwrite", lambda descriptor, data, offset: pwrite(descriptor, bytes(data)[:12], offset)
    )
    data = torch.randn(2, 5, 4)
    region.write(target, 6, data)  # slots 6, 7, then 0, 1, 2 (the ring wraps)
    assert torch.equal(target[:, [6, 7, 0, 1, 2]], data)
    file.close()


def test_a_full_disk_during_the_archive_write_is_one_line_naming_the_folder(tmp_path, monkeypatch):
    file, region, target = region_of(tmp_path)

    def full_disk(descriptor, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(ArchiveError) as failed:
        region.write(target, 0, torch.randn(2, 3, 4))
    message = str(failed.value)
    assert str(tmp_path) in message and "--archive ram" in message and "\n" not in message
    file.close()


# The C step's buffers and checks.


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@needs_compiler
def test_under_a_bf16_default_dtype_the_c_step_equals_the_torch_step():
    """A library user's `torch.set_default_dtype(torch.bfloat16)`: `h2o`'s C step gives the torch step's
    outputs and state, call by call (its buffers have their own dtypes)."""
    from conftest import assert_same_store
    from test_native_step import HEAD_DIM, N_HEADS, N_KV, make_layer

    generator = torch.Generator().manual_seed(3)
    with default_dtype(torch.bfloat16), mock.patch.object(native, "step", wraps=native.step) as c_calls:
        torch_layer, c_layer = make_layer("torch"), make_layer("native")
        start = 0
        for chunk in [6, 5] + [1] * 40:
            q, k, v = (
                torch.randn(heads, chunk, HEAD_DIM, generator=generator, dtype=torch.float32) * 2
                for heads in (N_HEADS, N_KV, N_KV)
            )
            want, got = feed_torch_and_c(torch_layer, c_layer, q, k, v, start, c_calls)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            assert_same_store(c_layer.store, torch_layer.store, start)
            start += chunk
    assert c_calls.call_count > 20


@needs_compiler
def test_under_a_bf16_default_dtype_the_c_page_scores_equal_the_torch_ones():
    """`recall`'s C page scores (`StepScores.bounds`, the buffers archive.c fills as float32) under a bf16
    default dtype, against `PageArchive.step_bounds` on a twin archive under float32: the same scores to float
    rounding, step after step while the ring wraps (with bf16 buffers the C code would write past them)."""
    from h2o_cli.cache.recall.archive import PageArchive, PageSettings
    from h2o_cli.cache.recall.c_step import StepScores

    n_kv, group, head_dim, page_size = 2, 3, 16, 4
    settings = PageSettings(page_size, attention=True, shortlist=5, carry=0.9, step_shortlist=2)
    torch_archive, c_archive = (
        PageArchive(n_kv, head_dim, 7 * page_size, settings, torch.float32, torch.device("cpu"))
        for _ in range(2)
    )
    scores = StepScores(c_archive)
    generator = torch.Generator().manual_seed(5)
    scored = 0
    for step in range(5 * c_archive.capacity):
        key, value = torch.randn(2, n_kv, 1 if step else 3 * page_size, head_dim, generator=generator)
        for archive in (torch_archive, c_archive):
            archive.write(key, value)
        if step % 8 == 0:  # a chunk scores every page: the carried scores the step ranks its shortlist by
            chunk = torch.randn(n_kv, 4 * group, head_dim, generator=generator) * 2
            for archive in (torch_archive, c_archive):
                archive.bounds(chunk, archive.span // page_size, chunk=4)
        query = torch.randn(n_kv, group, head_dim, generator=generator) * 2
        want = torch_archive.step_bounds(query)
        with default_dtype(torch.bfloat16):
            got = scores.bounds(query)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        scored += c_archive.steps_score_carried_shortlist()
    assert scored > 3 * c_archive.capacity  # the C scores ran


CHECKS_UNDER_O = """
import torch
from h2o_cli.cache.c_step import CStep
from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.cache.recall.c_step import StepScores
from h2o_cli.cache.store import LayerStore
from h2o_kernels import native, native_archive

def refused(make):
    try:
        make()
    except (TypeError, ValueError) as error:
        return str(error)
    return None

store = LayerStore(2, 8, 16, 4, torch.float32, torch.device("cpu"))
store.token_index = store.token_index.to(torch.int32)  # the C step reads 8 bytes a slot
wide = LayerStore(2, 8, 16, 4, torch.float32, torch.device("cpu"))
wide.keys = torch.zeros(2, 16, 16)  # rows twice the head_dim the step is told
half = PageArchive(2, 8, 64, PageSettings(4, attention=True, shortlist=4, carry=0.9, step_shortlist=2),
                   torch.float16, torch.device("cpu"))
ranked = torch.zeros(4, dtype=torch.int32)
print(refused(lambda: CStep(store)))
print(refused(lambda: CStep(wide)))
print(refused(lambda: StepScores(half)))
print(refused(lambda: native_archive.archive_lead_choose(8, (0, 0), 16, 0, 0, 64, 4, 1, (0, 0, 0), ranked, 1, 0,
                                                 (0, 0, 0), (0,) * 7, torch.zeros(2, dtype=torch.int64), None)))
"""


def test_the_checks_that_keep_the_c_step_in_bounds_hold_under_python_O():
    """`python -O` removes `assert`s: the checks on what the C code reads and writes (buffer dtypes, shapes,
    contiguity) are real ones, made once per store, so a store or archive it cannot take is refused."""
    run = subprocess.run(
        [sys.executable, "-O", "-c", CHECKS_UNDER_O],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ,
    )
    assert run.returncode == 0, run.stderr
    answers = run.stdout.splitlines()
    assert len(answers) == 4 and "None" not in answers, answers
