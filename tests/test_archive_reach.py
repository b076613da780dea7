"""How far the recall archive reaches: a million tokens by default on disk, its page summaries in the mapped
file beside the K/V, disk space reserved as the tokens come, and one line when a text outgrows the reach or
the disk holds less of it."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import run_stream

from h2o_cli.cache.recall import limits
from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.cache.recall.archive_file import ArchiveFile, aligned
from h2o_cli.cache.recall.limits import DEFAULT_ARCHIVE_MAX, archive_capacity, disk_reach
from h2o_cli.config import CacheSettings

HEAD_DIM, PAGE = 8, 16
# The default's settings of the page choice (attention mass, a shortlist, carried scores).
CHOICE = PageSettings(PAGE, attention=True, shortlist=64, carry=0.9, chunk_weight=8.0)


def file_archive(tmp_path, capacity: int, n_kv: int = 1, settings: PageSettings = CHOICE):
    """A float32 `PageArchive` of `capacity` tokens in a fresh mapped file: (archive, file)."""
    size = aligned(PageArchive.stored_bytes(n_kv, HEAD_DIM, capacity, torch.float32, None, 4))
    file = ArchiveFile(tmp_path / f"reach-{capacity}-{n_kv}.kv", size)
    archive = PageArchive(
        n_kv, HEAD_DIM, capacity, settings, torch.float32, torch.device("cpu"), region=file.region(size)
    )
    return archive, file


def write_text(archive: PageArchive, keys: torch.Tensor, piece: int = 4096) -> None:
    for start in range(0, keys.shape[1], piece):
        part = keys[:, start : start + piece]
        archive.write(part, part)


def test_a_reach_past_the_old_cap_keeps_a_page_planted_early(tmp_path):
    """The default reach (a million tokens, in a file) still holds a page planted at token 100 after 140,000
    tokens, and a question's choice finds it; the old default cap (131,072 tokens) had dropped it."""
    tokens, planted = 140_000, 100
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(1, tokens, HEAD_DIM, generator=generator) * 0.1
    query = torch.randn(1, 2, HEAD_DIM, generator=generator)
    keys[0, planted] = 4.0 * query[0, 0]  # the pass key's page: one key the question attends to
    capacity = archive_capacity(DEFAULT_ARCHIVE_MAX, PAGE, None, None)
    assert capacity == 1_048_576
    reach, file = file_archive(tmp_path, capacity)
    old = PageArchive(1, HEAD_DIM, 131072, CHOICE, torch.float32, torch.device("cpu"))
    for archive in (reach, old):
        write_text(archive, keys)
    assert reach.oldest == 0 and reach.held() == tokens
    assert old.oldest > planted  # what the old default reach had lost
    empty = torch.full((1, 1), -1)
    slots, valid = reach.choose(query, empty, tokens, PAGE, question=True)
    chosen = reach.token_index[slots[valid]]
    assert planted in chosen.tolist()
    assert (chosen // PAGE == planted // PAGE).all()  # the planted page ranked first, its 16 tokens taken
    # The disk holds what the text filled (and a stretch ahead), not the million tokens' reach.
    used = os.stat(file.path).st_blocks * 512
    assert used < reach.disk_bytes() / 4


def block_summaries(written: dict[int, torch.Tensor], capacity: int, n_kv: int, block: int) -> dict:
    """Per ring block holding a token: (high, low) [n_kv, head_dim], from the keys each slot holds now."""
    out = {}
    for first in range(0, capacity, block):
        held = [written[slot] for slot in range(first, first + block) if slot in written]
        if held:
            stacked = torch.stack(held)  # [tokens, n_kv, d]
            out[first // block] = (stacked.amax(dim=0), stacked.amin(dim=0))
    return out


def test_summaries_read_from_the_file_are_the_min_and_max_of_each_blocks_keys(tmp_path):
    """The summaries live in the mapped file: read back from its bytes (another descriptor, the page cache),
    each held block's are the per-channel max and min of the keys its slots hold (computed here slot by slot),
    and every value equals a RAM archive's given the same writes, through a wrap of the ring."""
    capacity, n_kv = 64, 2
    disk, file = file_archive(tmp_path, capacity, n_kv)
    ram = PageArchive(n_kv, HEAD_DIM, capacity, CHOICE, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(5)
    written: dict[int, torch.Tensor] = {}
    token = 0
    for count in (5, 1, 1, 23, 40, 1, 37, 1):  # pieces and one-token writes, 109 tokens: the ring wraps
        keys = torch.randn(n_kv, count, HEAD_DIM, generator=generator)
        for archive in (disk, ram):
            archive.write(keys, keys)
        for offset in range(count):
            slot = (token + offset) % capacity
            if (token + offset) % PAGE == 0:  # a page starts: the ring page's old tokens are gone
                for old in range(slot, slot + PAGE):
                    written.pop(old, None)
            written[slot] = keys[:, offset]
        token += count
    offset, nbytes = disk.summary.data_ptr() - file.base, disk.summary.nbytes
    raw = os.pread(os.open(file.path, os.O_RDONLY), nbytes, offset)
    in_file = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(disk.summary.shape)
    assert torch.equal(in_file, ram.summary)
    for block, (high, low) in block_summaries(written, capacity, n_kv, 4).items():
        assert torch.equal(in_file[:, block, :HEAD_DIM], high)
        assert torch.equal(in_file[:, block, HEAD_DIM:], low)
    assert disk.ram_bytes() == capacity * 8  # the token index only
    assert disk.disk_bytes() == ram.ram_bytes() - capacity * 8


def test_a_text_past_the_reach_is_told_in_one_line(tiny_pair, capsys):
    """Every layer drops its first page at the same token: one line on stderr says so, once; `--json`'s
    `archive_oldest` says how far back recall then reaches. Within the reach: no line."""
    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(2))
    settings = dict(budget=24, policy="recall", chunk=8, page_size=4)
    _, cache = run_stream(model, CacheSettings(**settings, archive_max=64), ids, 8)
    lines = capsys.readouterr().err.splitlines()
    told = [line for line in lines if "outgrew" in line]
    assert len(told) == 1 and "token 64" in told[0] and "64 tokens" in told[0], lines
    assert cache.archive_summary().archive_oldest > 0
    _, cache = run_stream(model, CacheSettings(**settings, archive_max=256), ids, 8)
    assert "outgrew" not in capsys.readouterr().err and cache.archive_summary().archive_oldest == 0


def test_a_disk_too_small_for_the_reach_shrinks_it_in_one_line(tiny_pair, tmp_path, monkeypatch, capsys):
    """`disk_reach`: the whole pages that the free space (less `DISK_SPARE`) holds, said in one line; the
    reach itself when it fits, silently. A cache built on such a disk takes the smaller reach."""
    token_bytes = 1000
    fits = disk_reach(4096, PAGE, token_bytes, limits.DISK_SPARE + 4096 * token_bytes, tmp_path)
    assert fits == 4096 and capsys.readouterr().err == ""
    short = disk_reach(4096, PAGE, token_bytes, limits.DISK_SPARE + 1000 * token_bytes, tmp_path)
    assert short == 992  # 1000 tokens, in whole pages of 16
    (line,) = capsys.readouterr().err.splitlines()
    assert str(tmp_path) in line and "992" in line and "4,096" in line
    _, model = tiny_pair
    monkeypatch.setattr(limits, "free_bytes", lambda place: limits.DISK_SPARE + 100_000)
    settings = CacheSettings(budget=24, policy="recall", chunk=8, archive=f"{tmp_path}/", archive_max=4096)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    _, cache = run_stream(model, settings, ids, 8)
    report = cache.archive_summary()
    assert report.archive_storage == "disk" and report.archive_capacity < 4096
    assert report.archive_disk_bytes <= 100_000
    assert len([line for line in capsys.readouterr().err.splitlines() if "has room for" in line]) == 1
    cache.close()


@pytest.mark.parametrize("storage", ["ram", "auto"])
def test_the_default_reach_in_ram_stays_at_the_old_cap(tiny_pair, storage, monkeypatch):
    """A million tokens is the disk's reach: an archive kept in RAM (asked, or `auto` under its limit) takes
    `RAM_ARCHIVE_MAX` by default, and a reach the user gives as it is."""
    _, model = tiny_pair
    monkeypatch.setattr(limits, "AUTO_RAM_BYTES", 2**40)
    from h2o_cli.cache import H2OCache

    cache = H2OCache(model, CacheSettings(budget=24, policy="recall", chunk=8, archive=storage))
    assert cache.archive_summary().archive_capacity == limits.RAM_ARCHIVE_MAX
    given = H2OCache(
        model, CacheSettings(budget=24, policy="recall", chunk=8, archive=storage, archive_max=200_000)
    )
    assert given.archive_summary().archive_capacity == 200_000
