"""A cache resumed from a saved read maps the save's archive file instead of copying it
(h2o_cli.saved_archive, `ArchiveFile.adopt`): what it reads is the save's, what it writes after stays its own
(through `release`, which drops pages, and `settle`, which moves everything into its own file), and the save
keeps its bytes. Checked against the reading cache that went on without a save."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from test_saved_read import ids, read, settings_of, tiny  # noqa: F401  (`tiny` is a fixture)

from h2o_cli.cache import H2OCache
from h2o_cli.cache.recall import archive_file
from h2o_cli.saved import model_identity, open_saved, write_saved
from h2o_cli.saved_checks import resume_settings
from h2o_cli.streaming import prefill

TEXT, MORE, CHUNK = 150, 40, 8


def archives(cache: H2OCache) -> list[dict[str, torch.Tensor]]:
    """Every recall layer's archive arrays (the written ring, its index and summaries), as copies."""
    return [
        {name: tensor.clone() for name, tensor in layer.archive.saved_arrays().items()}
        for layer in cache.layers
        if layer.archive is not None
    ]


def go_on(model, cache: H2OCache, text: list[int]) -> None:
    _, stats = prefill(model, cache, [text], CHUNK)
    stats.reraise()
    for layer in cache.layers:  # every page leaves the process that may: what is read next is what stays
        if layer.archive is not None:
            layer.archive.release()


def saved_files(folder) -> dict:
    """Every file of a save by path: a SHA-256 of its data extents with their offsets (a sparse archive.kv
    of a chat's reach is tens of GB of holes)."""
    import hashlib

    digests = {}
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        digest, size = hashlib.sha256(), path.stat().st_size
        with open(path, "rb") as file:
            offset = 0
            while offset < size:
                try:
                    offset = os.lseek(file.fileno(), offset, os.SEEK_DATA)
                except OSError:  # ENXIO: no data past offset
                    break
                end = os.lseek(file.fileno(), offset, os.SEEK_HOLE)
                file.seek(offset)
                digest.update(f"{offset}:".encode() + file.read(end - offset))
                offset = end
        digests[path] = (size, digest.hexdigest())
    return digests


@pytest.mark.parametrize("bits", [None, 8])
@pytest.mark.parametrize("settle_after", [None, 16])
def test_a_resumed_file_archive_maps_the_save_and_keeps_what_it_writes(
    tiny,  # noqa: F811
    tmp_path,
    monkeypatch,
    bits,
    settle_after,
):
    """The resumed archive adopts the save's file; after more text its arrays equal those of the reading
    cache that went on, read back through the mapping after `release` (so the tokens written since were not
    dropped with the save's pages); with `settle_after` tokens it settles into its own file first (then what
    is read back after `release` comes from that file). The save keeps every byte."""
    if settle_after is not None:
        monkeypatch.setattr(archive_file, "SETTLE_TOKENS", settle_after)
    settings = replace(settings_of("recall", "torch"), archive=f"{tmp_path}/archives/", archive_bits=bits)
    reader = read(tiny, settings, ids(TEXT, 11))
    write_saved(tmp_path / "read", reader, model_identity(tiny, "tiny"), {})
    before = saved_files(tmp_path / "read")
    assert (tmp_path / "read" / "archive.kv").is_file()
    saved = open_saved(tmp_path / "read")
    resumed = H2OCache(tiny, resume_settings(saved, {}))
    saved.load_into(resumed)
    assert resumed.archive_file.adopted
    more = ids(MORE, 12)
    go_on(tiny, reader, more)
    go_on(tiny, resumed, more)
    assert resumed.archive_file.adopted == (settle_after is None)
    for want, got in zip(archives(reader), archives(resumed), strict=True):
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), name
    assert saved_files(tmp_path / "read") == before


def test_an_archive_of_another_layout_is_copied_not_mapped(tiny, tmp_path):  # noqa: F811
    """A save whose archive lies in a file, resumed with the archive in RAM (`--archive ram`): nothing to
    map, the arrays are copied, and the archive is the reading cache's."""
    settings = replace(settings_of("recall", "torch"), archive=f"{tmp_path}/archives/")
    reader = H2OCache(tiny, settings, archive_span=1024)  # the reach a text's save gives: the same in RAM
    go_on(tiny, reader, ids(TEXT, 13))
    write_saved(tmp_path / "read", reader, model_identity(tiny, "tiny"), {})
    saved = open_saved(tmp_path / "read")
    resumed = H2OCache(tiny, resume_settings(saved, {"archive": "ram"}), archive_span=1024)
    saved.load_into(resumed)
    assert resumed.archive_file is None
    for want, got in zip(archives(reader), archives(resumed), strict=True):
        for name in want:
            assert torch.equal(want[name], got[name]), name


def damage(folder) -> None:
    """Flip one byte of the first array in `folder/archive.kv`."""
    saved = open_saved(folder)
    entry = next(entry for entry in saved.manifest["arrays"].values() if "offset" in entry and entry["bytes"])
    with open(folder / "archive.kv", "r+b") as file:
        file.seek(entry["offset"] + 3)
        byte = file.read(1)
        file.seek(entry["offset"] + 3)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_a_damaged_archive_file_is_found_and_nothing_is_saved_from_it(tiny, tmp_path):  # noqa: F811
    """The mapped archive is checked while the resumed cache answers (`verified`): a damaged one is one
    line naming archive.kv."""
    from h2o_cli.errors import H2OError

    settings = replace(settings_of("recall", "torch"), archive=f"{tmp_path}/archives/")
    write_saved(tmp_path / "read", read(tiny, settings, ids(TEXT, 14)), model_identity(tiny, "tiny"), {})
    damage(tmp_path / "read")
    saved = open_saved(tmp_path / "read")
    resumed = H2OCache(tiny, resume_settings(saved, {}))
    saved.load_into(resumed)
    assert resumed.archive_file.adopted
    with pytest.raises(H2OError, match="damaged .*archive.kv"):
        saved.verified()
    undamaged = open_saved(tmp_path / "read")  # (a fresh open checks again)
    with pytest.raises(H2OError, match="damaged .*archive.kv"):
        undamaged.arrays.check_archive()


def test_a_chat_resumed_from_a_damaged_archive_saves_nothing(smollm, tmp_path):
    """The damage would be copied into the chat's next save: `save_read` refuses in one line, and the
    previous save is left as it was."""
    from h2o_cli.chat import ChatSession
    from h2o_cli.config import CacheSettings
    from h2o_cli.errors import H2OError
    from h2o_cli.generation import Sampling

    model, tokenizer = smollm
    settings = CacheSettings(budget=48, policy="recall", chunk=16, archive=f"{tmp_path}/archives/")
    talk = ChatSession(model, tokenizer, settings, Sampling(max_new_tokens=4), system="Be brief.")
    talk.ask("Name three colours.")
    talk.save_read(tmp_path / "chat", "smollm2-135m")
    damage(tmp_path / "chat")
    before = saved_files(tmp_path / "chat")
    saved = open_saved(tmp_path / "chat")
    resumed = ChatSession(
        model, tokenizer, resume_settings(saved, {}), Sampling(max_new_tokens=4), "Be brief."
    )
    resumed.load_read(saved, "smollm2-135m")
    assert resumed.cache.archive_file.adopted
    with pytest.raises(H2OError, match="damaged .*archive.kv"):
        resumed.save_read(tmp_path / "chat", "smollm2-135m")
    assert saved_files(tmp_path / "chat") == before


def test_a_resume_takes_the_saved_reach_whatever_the_disk_holds_now(tiny, tmp_path, monkeypatch):  # noqa: F811
    """A file archive's reach follows the disk's free space (`disk_reach`); the disk holds more or less when the
    save is resumed, yet the resumed archive has the save's reach (`SavedRead.archive_reach`), maps it, and
    goes on as the reading cache does."""
    from h2o_cli.cache.recall import limits

    def reach_of(tokens):
        return lambda capacity, page, *rest: min(capacity, tokens)

    settings = replace(settings_of("recall", "torch"), archive=f"{tmp_path}/archives/")
    monkeypatch.setattr(limits, "disk_reach", reach_of(1024))
    reader = read(tiny, settings, ids(TEXT, 15))
    write_saved(tmp_path / "read", reader, model_identity(tiny, "tiny"), {})
    monkeypatch.setattr(limits, "disk_reach", reach_of(2048))
    saved = open_saved(tmp_path / "read")
    assert saved.archive_reach == 1024
    resumed = H2OCache(tiny, resume_settings(saved, {}), archive_reach=saved.archive_reach)
    saved.load_into(resumed)
    assert resumed.archive_file.adopted
    go_on(tiny, reader, ids(MORE, 16))
    go_on(tiny, resumed, ids(MORE, 16))
    for want, got in zip(archives(reader), archives(resumed), strict=True):
        for name in want:
            assert torch.equal(want[name], got[name]), name
