"""The bytes of a saved read's arrays (`array_pieces`, `Checksum`), and the recall archive's file in it:
written as the cache's own file lies, and adopted, not copied, by a cache resumed from it.

A cache whose archive is a memory-mapped file (`h2o_cli.cache.recall.archive_file`) saves the arrays that lie
in that file into one file of the save, `archive.kv`, of the same size, each array's bytes at its own offset
(sparse: only the rows its tokens filled take disk). The manifest's `archive` names it with its size and the
file's `layout` (every tensor's offset, dtype and shape); each such array's entry gives its offset and
strides into it, its bytes and checksum as any array's. A cache resumed from the save with the same layout
(same model, settings and reach) maps `archive.kv` copy-on-write over its own file's addresses
(`ArchiveFile.adopt`): its first token does not wait for the archive to be copied, which for a long text is
most of the save. Any other cache (an archive in RAM, another reach) copies out of the same views.
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from h2o_cli.private import FILE_MODE, write_all

ARCHIVE = "archive.kv"
PIECE = 64 << 20  # bytes written or checked at a time


class Checksum:
    """The array files' checksum: the sum of the bytes' little-endian 64-bit words (the last one zero-padded),
    modulo 2**64, and the byte count. It finds a truncated or changed file (not a forged one) at memory speed.
    `update` takes the bytes piece by piece, of any sizes."""

    def __init__(self) -> None:
        self.total, self.count, self.tail = 0, 0, b""

    def update(self, data) -> Checksum:
        view = memoryview(data).cast("B")
        self.count += len(view)
        if self.tail:
            taken = min(8 - len(self.tail), len(view))
            self.tail, view = self.tail + bytes(view[:taken]), view[taken:]
            if len(self.tail) == 8:
                self.total += int.from_bytes(self.tail, "little")
                self.tail = b""
        whole = len(view) // 8 * 8
        if whole:
            self.total += int(np.frombuffer(view[:whole], dtype="<u8").sum(dtype=np.uint64))
        self.tail += bytes(view[whole:])
        return self

    def hex(self) -> str:
        total = self.total + int.from_bytes(self.tail.ljust(8, b"\0"), "little") if self.tail else self.total
        return f"sum64:{total % 2**64:016x}:{self.count}"


def array_pieces(tensor: torch.Tensor):
    """The tensor's bytes in C order, as contiguous pieces of at most `PIECE` bytes (numpy views of CPU
    tensors; a strided view, a ring's written part, goes row by row without copying the whole)."""
    tensor = tensor.detach().cpu()
    if tensor.numel() == 0:
        return
    if not tensor.is_contiguous() and tensor.dim() > 1:
        for row in tensor:
            yield from array_pieces(row)
        return
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    for start in range(0, data.size, PIECE):
        yield data[start : start + PIECE]


def in_file(cache, arrays: dict[str, torch.Tensor]) -> set[str]:
    """The names of `arrays` whose data lies in `cache`'s archive file (none without one)."""
    file = getattr(cache, "archive_file", None)
    if file is None:
        return set()
    return {name for name, tensor in arrays.items() if tensor.numel() and file.holds(tensor)}


def write_archive(folder: Path, cache, arrays: dict[str, torch.Tensor], names: set[str]):
    """Write `arrays[name]` for `names` (views into `cache.archive_file`) into `folder/archive.kv` at their
    offsets, synced. Returns the manifest's `archive` and the arrays' entries (`Checksum`s of their bytes)."""
    file = cache.archive_file
    descriptor = os.open(folder / ARCHIVE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    entries = {}
    try:
        os.fchmod(descriptor, FILE_MODE)
        os.ftruncate(descriptor, file.size)  # sparse: the rows below are all that takes disk
        for name in sorted(names):
            tensor, summed = arrays[name], Checksum()
            for piece in array_pieces(tensor):
                write_all(descriptor, piece.data, piece.ctypes.data - file.base)
                summed.update(piece.data)
            entries[name] = {
                "file": ARCHIVE,
                "offset": tensor.data_ptr() - file.base,
                "strides": list(tensor.stride()),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "bytes": tensor.numel() * tensor.element_size(),
                "checksum": summed.hex(),
            }
            for region in file.regions:  # the pages just read leave the process (private ones stay)
                region.release()
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return {"file": ARCHIVE, "bytes": file.size, "layout": file.layout()}, entries


def archive_view(data: mmap.mmap, entry: dict) -> torch.Tensor:
    """The array of `entry` (offset, strides, dtype, shape) over `archive.kv`, mapped read-only (a private
    writable map of a reach of GBs would be charged to the commit limit): never written, only copied from."""
    dtype = getattr(torch, entry["dtype"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        whole = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
    return whole.as_strided(entry["shape"], entry["strides"], entry["offset"] // dtype.itemsize)


def adopt(saved, cache) -> bool:
    """Map the save's `archive.kv` over `cache`'s archive file (`ArchiveFile.adopt`) when the two have the same
    size and layout, and start checking the checksums of every array in it meanwhile
    (`SavedArrays.check_archive_meanwhile`: a save not in the page cache is read from disk once, GBs for a
    long text, which the first answer need not wait for; `SavedRead.verified` says what the check found).
    True when adopted: those arrays are then in place, and `load_saved` leaves them."""
    file, spec = getattr(cache, "archive_file", None), saved.manifest.get("archive")
    if file is None or spec is None or spec["bytes"] != file.size or spec["layout"] != file.layout():
        return False
    descriptor = os.open(Path(saved.path) / ARCHIVE, os.O_RDONLY)
    try:
        adopted = file.adopt(descriptor)
    finally:
        os.close(descriptor)
    if adopted:
        saved.arrays.check_archive_meanwhile()
    return adopted
