"""A saved read: an `H2OCache`'s whole state in one folder, to go on from without reading the text again.

The folder (docs/design.md, "How is a read saved, and why can a question not change it?"):
- `manifest.json`: the format and its version, the model's identity (`model_identity`), the cache settings,
  every layer's counters (`H2OCache.saved_counters`), what the caller keeps (`extra`: a text's identity, a
  chat's transcript), and for every array its file, dtype, shape, size in bytes and checksum;
- `arrays/N.bin`: each array of `H2OCache.saved_arrays` as raw little-endian bytes, C order (a file maps as
  `numpy.memmap(file, dtype, shape=shape)`);
- `archive.kv`: where the recall archive lives in a memory-mapped file, the arrays in that file, as the file
  lies (`h2o_cli.saved_archive`: a resumed cache maps it instead of copying it).

It is written into a new folder beside its place, each file synced, then renamed into place (`write_saved`):
an interrupted save (Ctrl-C, a full disk, SIGKILL) leaves the previous save whole. Files are 0600 in 0700
folders (`h2o_cli.private`). Reading (`open_saved`) maps every file copy-on-write at once, so a save replaced
meanwhile is not mixed into the one being read; a cache loaded from it copies out of the maps or maps the
archive copy-on-write: what it then writes never reaches the save. A process that will write a save again
holds its lock (`saved_checks.SaveLock`, beside the resume checks); readers take none.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import shutil
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from h2o_cli.errors import H2OError
from h2o_cli.private import FILE_MODE, FOLDER_MODE, FULL, private_folder, write_all
from h2o_cli.saved_archive import Checksum, array_pieces

FORMAT = "h2o saved read"
VERSION = 3  # 2: a store's pinned flags and pins; 3: the archive's file as it lies, no unread tail
MANIFEST = "manifest.json"


def model_identity(model, name: str) -> dict:
    """What a save records of its model: `name` (as the user gave it), the compute dtype, the quantisation,
    and a fingerprint of the weights (SHA-256 over every parameter's name, shape, dtype and up to 4,096 of its
    values, evenly spaced): cheap for any size, and changed by other weights, another dtype or quantisation."""
    import hashlib

    digest = hashlib.sha256()
    for parameter_name, parameter in model.named_parameters():
        digest.update(f"{parameter_name}:{tuple(parameter.shape)}:{parameter.dtype}".encode())
        if parameter.is_meta or parameter.numel() == 0:
            continue
        flat = parameter.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)][:4096]
        digest.update(sample.float().cpu().numpy().tobytes())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {
        "name": name,
        "dtype": dtype,
        "quant": getattr(model, "h2o_quant", "none"),
        "fingerprint": digest.hexdigest(),
    }


def check_room(folder: Path, size: int) -> None:
    """Raise H2OError unless `folder`'s file system has `size` bytes free (and 1 MiB for the manifest)."""
    status = os.statvfs(folder)
    free = status.f_bavail * status.f_frsize
    if free < size + (1 << 20):
        raise H2OError(
            f"the save needs {size:,} bytes in {folder}, which has {free:,} free; nothing was written: "
            "free some space or save elsewhere"
        )


def write_saved(path: str | Path, cache, model: dict, extra: dict) -> int:
    """Write `cache`'s state (`H2OCache.saved_arrays`, `saved_counters`, its settings) with the `model`
    identity (`model_identity`) and the caller's `extra` (JSON data) as a saved read at `path`, replacing a
    previous one atomically (module docs). Returns the bytes written. Raises H2OError in one line, before
    writing, when the disk lacks the room; on any failure the previous save at `path` stays whole."""
    from h2o_cli.saved_archive import in_file, write_archive

    path = Path(path).expanduser().absolute()
    folder = private_folder(path.parent) if not path.parent.exists() else path.parent
    arrays = cache.saved_arrays()
    archived = in_file(cache, arrays)
    size = sum(tensor.numel() * tensor.element_size() for tensor in arrays.values())  # the manifest aside
    check_room(folder, size)
    _sweep(folder, path.name)
    aside = folder / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        private_folder(aside / "arrays")
        os.chmod(aside, FOLDER_MODE)
        archive, entries = write_archive(aside, cache, arrays, archived) if archived else (None, {})
        for number, (name, tensor) in enumerate(arrays.items()):
            if name in archived:
                continue
            file = f"arrays/{number}.bin"
            entries[name] = {
                "file": file,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "bytes": tensor.numel() * tensor.element_size(),
                "checksum": _write_array(aside / file, tensor),
            }
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "byteorder": "little",
            "model": model,
            "settings": asdict(cache.settings),
            "counters": cache.saved_counters(),
            "extra": extra,
            "arrays": entries,
        } | ({"archive": archive} if archive else {})
        _write_file(aside / MANIFEST, json.dumps(manifest, ensure_ascii=False).encode())
        _sync_folder(aside)
        _swap(aside, path)
    except BaseException as error:
        shutil.rmtree(aside, ignore_errors=True)
        if isinstance(error, OSError):
            fix = "free some space or save elsewhere" if error.errno in FULL else "save elsewhere"
            raise H2OError(
                f"cannot write the save {path} ({error.strerror or error}); any previous save there is whole: "
                f"{fix}"
            ) from None
        raise
    return size


def _write_array(file: Path, tensor: torch.Tensor) -> str:
    descriptor = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    checksum = Checksum()
    try:
        os.fchmod(descriptor, FILE_MODE)
        for piece in array_pieces(tensor):
            write_all(descriptor, piece.data)
            checksum.update(piece.data)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return checksum.hex()


def _write_file(file: Path, data: bytes) -> None:
    descriptor = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        os.fchmod(descriptor, FILE_MODE)
        write_all(descriptor, data)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _swap(aside: Path, path: Path) -> None:
    """Put the written folder `aside` at `path`: the previous save (if any) is renamed out of the way, the new
    one in, then the previous one removed. Between the two renames only the previous one exists (as
    `.NAME.old-*`), and `open_saved` reads it there."""
    old = None
    if path.exists() or path.is_symlink():
        if not (path / MANIFEST).is_file():
            raise H2OError(f"{path} exists and is not a saved read; save elsewhere or remove it")
        old = path.with_name(f".{path.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(path, old)
    os.rename(aside, path)
    _sync_folder(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sweep(folder: Path, name: str) -> None:
    """Remove what saves to `name` killed outright left in `folder` (`.NAME.tmp-PID-*` of a gone process)."""
    for entry in folder.glob(f".{name}.tmp-*"):
        pid = entry.name.removeprefix(f".{name}.tmp-").split("-")[0]
        if pid.isdigit() and 0 < int(pid) < 2**31 and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SavedArrays:
    """The arrays of a save by name, as CPU tensors over copy-on-write maps of its files (`archive_map` the map
    of its `archive.kv`, if any); each array's checksum is checked when it is first read (H2OError naming the
    file when it differs)."""

    def __init__(self, path: Path, entries: dict, maps: dict, archive_map=None) -> None:
        self.path, self.entries, self.maps, self.archive_map = path, entries, maps, archive_map
        self._checked: set[str] = set()
        self._checking: threading.Thread | None = None
        self._damage: H2OError | None = None

    def _check(self, name: str, pieces) -> None:
        if name in self._checked:
            return
        summed = Checksum()
        for piece in pieces:
            summed.update(piece)
        if summed.hex() != self.entries[name]["checksum"]:
            raise H2OError(
                f"the save {self.path} is damaged ({self.entries[name]['file']} differs); save it again"
            )
        self._checked.add(name)

    def check_archive_meanwhile(self) -> None:
        """Start `check_archive` in a thread (its reads and sums release the GIL): a cache that maps
        `archive.kv` answers while the save's pages are read from disk once to be checked. `verified` waits
        for it and raises what it found."""

        def check() -> None:
            try:
                self.check_archive()
            except H2OError as error:
                self._damage = error

        self._checking = threading.Thread(target=check, name="h2o-save-check", daemon=True)
        self._checking.start()

    def verified(self) -> None:
        """Wait for `check_archive_meanwhile` (if started); H2OError naming a damaged array."""
        if self._checking is not None:
            self._checking.join()
        if self._damage is not None:
            raise self._damage

    def check_archive(self) -> None:
        """Check the checksum of every array in `archive.kv` now (H2OError naming it when one differs), the
        pages read leaving the process after each."""
        from h2o_cli.saved_archive import archive_view

        for name, entry in self.entries.items():
            if "offset" in entry and entry["bytes"]:
                self._check(
                    name, (piece.data for piece in array_pieces(archive_view(self.archive_map, entry)))
                )
                self.archive_map.madvise(mmap.MADV_DONTNEED)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str, default=None):
        return self[name] if name in self.entries else default

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = getattr(torch, entry["dtype"])
        if entry["bytes"] == 0:
            return torch.empty(entry["shape"], dtype=dtype)
        if "offset" in entry:
            from h2o_cli.saved_archive import archive_view

            view = archive_view(self.archive_map, entry)
            self._check(name, (piece.data for piece in array_pieces(view)))
            return view
        data = self.maps[name]
        self._check(name, [data])
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(entry["shape"])


@dataclass
class SavedRead:
    """An opened save: its folder, its manifest and its arrays (`SavedArrays`)."""

    path: Path
    manifest: dict
    arrays: SavedArrays

    @property
    def extra(self) -> dict:
        return self.manifest["extra"]

    @property
    def settings(self) -> dict:
        return self.manifest["settings"]

    @property
    def archive_reach(self) -> int | None:
        """The recall archive's capacity in tokens (None without one), for the resumed cache (`H2OCache`)."""
        for layer in self.manifest["counters"]["layers"]:
            if "archive" in layer:
                return layer["archive"]["capacity"]
        return None

    @property
    def size(self) -> int:
        """Bytes of its arrays."""
        return sum(entry["bytes"] for entry in self.manifest["arrays"].values())

    def verified(self) -> None:
        """H2OError when the check `load_into` started of a mapped archive found damage (what a cache resumed
        from it answered may be wrong; save nothing from it). Waits for the check to end."""
        self.arrays.verified()

    def load_into(self, cache) -> None:
        """Put the saved state into `cache` (built with the saved settings: `resume_settings`): its archive
        file adopts the save's (`h2o_cli.saved_archive.adopt`) where it can, and the rest is copied."""
        from h2o_cli.saved_archive import adopt

        try:
            adopt(self, cache)
            cache.load_saved(self.arrays, self.manifest["counters"])
        except (KeyError, RuntimeError, TypeError, ValueError) as error:
            raise H2OError(
                f"the save {self.path} does not fit this cache ({type(error).__name__}: {error}); save it again"
            ) from None


def is_saved_read(path: str | Path) -> bool:
    """Whether `path` names a saved read (a folder), rather than a file (a transcript)."""
    path = Path(path).expanduser()
    return path.is_dir() or (not path.exists() and _interrupted(path) is not None)


def _interrupted(path: Path) -> Path | None:
    """The previous save a swap left renamed aside when it was killed between its two renames (`_swap`)."""
    found = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.is_dir() else []
    return next((old for old in found if (old / MANIFEST).is_file()), None)


def open_saved(path: str | Path) -> SavedRead:
    """Open the save at `path`: check its manifest (format, version, byte order) and map every array file
    (sizes checked now, checksums when read). Raises H2OError in one line naming what is wrong."""
    path = Path(path).expanduser()
    if not path.is_dir():
        old = _interrupted(path)
        if old is None:
            raise H2OError(f"{path} is not a saved read (no such folder); save one with --save")
        path = old
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        raise H2OError(f"cannot open the save {path}: {error.strerror}") from None
    try:
        manifest = _manifest(path, folder)
        entries = manifest["arrays"]
        maps = {name: _map(path, folder, entry) for name, entry in entries.items() if "offset" not in entry}
        archive = _map(path, folder, manifest["archive"], mmap.ACCESS_READ) if "archive" in manifest else None
    finally:
        os.close(folder)
    return SavedRead(path, manifest, SavedArrays(path, entries, maps, archive))


def _manifest(path: Path, folder: int) -> dict:
    try:
        descriptor = os.open(MANIFEST, os.O_RDONLY, dir_fd=folder)
        with os.fdopen(descriptor, "rb") as file:
            manifest = json.loads(file.read())
    except FileNotFoundError:
        raise H2OError(f"{path} is not a saved read (no {MANIFEST}); save one with --save") from None
    except (OSError, ValueError) as error:
        raise H2OError(f"the save {path} is damaged ({MANIFEST}: {error}); save it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise H2OError(f"{path} is not a saved read (its {MANIFEST} names no h2o save)")
    if manifest.get("version") != VERSION:
        raise H2OError(
            f"{path} is a save of format version {manifest.get('version')}; this h2o reads version {VERSION}: "
            "read the text again with this version"
        )
    if manifest.get("byteorder") != sys.byteorder:
        raise H2OError(
            f"{path} was saved on a {manifest.get('byteorder')}-endian machine; read the text here"
        )
    return manifest


def _map(path: Path, folder: int, entry: dict, access: int = mmap.ACCESS_COPY):
    try:
        descriptor = os.open(entry["file"], os.O_RDONLY, dir_fd=folder)
    except OSError as error:
        raise H2OError(
            f"the save {path} is damaged ({entry['file']}: {error.strerror}); save it again"
        ) from None
    try:
        size = os.fstat(descriptor).st_size
        if size != entry["bytes"]:
            raise H2OError(
                f"the save {path} is damaged ({entry['file']} holds {size:,} bytes of {entry['bytes']:,}); "
                "save it again"
            )
        return mmap.mmap(descriptor, size, access=access) if size else None
    finally:
        os.close(descriptor)
