"""Where the `recall` archive's K/V and page summaries live on disk: one memory-mapped file per cache, never
kept resident.

`--archive disk` names a fresh file in `$H2O_HOME/archive/`, `--archive PATH` a file (or a fresh name inside a
folder; a folder it makes, and `$H2O_HOME/archive/` always, is 0700, the file 0600). The file is sized for the
whole reach when the cache is built but sparse: its space is reserved as the tokens come (`reserve`,
`posix_fallocate` a stretch of ring slots ahead of the writes), so a reach of a million tokens costs the disk
what the text has filled, and a full disk is a one-line error before any write, not a crash in the middle of a
stream (where the file system cannot reserve, the free space is checked instead, since the C step's writes
through the mapping into a full disk would end the process with SIGBUS); each layer's K/V and summaries lie
in their own region, aligned to the OS page size. The archive writes through the file (`os.pwrite`, or the C
step through the mapping) and reads the chosen tokens as tensors over the mapping (read at random: no
readahead); after every read `release()`'s `madvise(MADV_DONTNEED)` takes the region's pages out of the
process (the page cache keeps them), so the peak RSS does not grow with the archive. The file is removed
when its cache is closed or collected, or at the latest when the interpreter exits (normal end, exception,
Ctrl-C; SIGTERM and SIGHUP for the `h2o` command),
unless it is kept (`--keep-archive`). A run killed outright (SIGKILL) leaves its file: the next archive made in
the same folder removes the files whose process is gone.

A cache resumed from a saved read (`h2o_cli.saved_archive`) *adopts* the save's copy of such a file instead
of copying it: `ArchiveFile.adopt` maps the save's file copy-on-write over the same addresses, so every tensor
laid out in the file reads the save's pages in place (from the page cache, as they are touched), and what the
cache writes after (its new tokens, their summaries) goes into private pages of the process, never into the
save. Those pages stay resident (`release` drops every other page): a resumed cache holds in RAM what it has
archived since it was resumed, until it `settle`s into its own file (after `SETTLE_TOKENS` tokens, or on
request), as an archive that was never saved would be.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
import weakref
from pathlib import Path

import torch

from h2o_cli.cache.recall.archive_folder import (
    ARCHIVE_FOLDER,
    FIX,
    check_free_space,
    remove_stale,
    unlink_unless,
)
from h2o_cli.errors import ArchiveError
from h2o_cli.private import h2o_home, private_folder, write_all

ALIGN = mmap.PAGESIZE
MAP_FIXED = 0x10  # Linux and the BSDs: mmap replaces what the address range held
MAP_NORESERVE = 0x4000  # Linux: a private writable mapping charges no commit (a reach of GBs is mostly holes)
SETTLE_TOKENS = 8192  # tokens a resumed archive holds in private pages before it settles into its own file


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to whole OS pages (each region of the file starts on a page)."""
    return -(-nbytes // ALIGN) * ALIGN


class ArchiveFile:
    """A file of `size` bytes mapped shared into the process; `region(nbytes)` hands out consecutive regions.
    The file is created new (an existing one is an error) with mode 0600: it holds the text's keys and values."""

    def __init__(self, path: Path, size: int, keep: bool = False) -> None:
        self.path, self.size, self.keep = Path(path), size, keep
        self._next = 0
        try:
            folder = self.path.parent
            if folder == h2o_home() / ARCHIVE_FOLDER or not folder.exists():
                private_folder(folder)  # the text's keys and values: nobody else's to list
            remove_stale(folder)
            # Never an existing file: `--archive notes.txt` by mistake must not truncate (and remove) notes.txt.
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if not self.path.parent.is_dir():  # mkdir met a file where a folder should be
                raise ArchiveError(
                    f"cannot create the recall archive {self.path} ({self.path.parent} is not a folder); "
                    "choose a writable place with --archive PATH, or keep it in memory with --archive ram"
                ) from None
            raise ArchiveError(
                f"{self.path} exists; the recall archive never overwrites a file: remove it, or give a new "
                "file name or a folder with --archive PATH"
            ) from None
        except OSError as error:
            raise ArchiveError(
                f"cannot create the recall archive {self.path} ({error.strerror}); choose a writable place "
                "with --archive PATH, or keep it in memory with --archive ram"
            ) from None
        # From here on the file exists: it is removed on every way out unless kept.
        self._finalizer = weakref.finalize(self, unlink_unless, self.path, keep)
        try:
            os.ftruncate(descriptor, size)  # sparse: each region reserves its space as its tokens come
            self.map = mmap.mmap(descriptor, size, flags=mmap.MAP_SHARED)
            _advise(self.map, mmap.MADV_RANDOM, 0, self.size)
        except (OSError, ArchiveError) as error:
            os.close(descriptor)
            self._finalizer()
            if isinstance(error, ArchiveError):
                raise
            raise ArchiveError(
                f"cannot reserve {size:,} bytes for the recall archive {self.path} ({error.strerror}); "
                "lower --archive-max, choose another place with --archive PATH, or use --archive ram"
            ) from None
        self.descriptor = descriptor
        self._closer = weakref.finalize(self, os.close, descriptor)
        self.base = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()
        self.regions: list[ArchiveRegion] = []
        self.adopted = False  # the mapping is a saved file's, copy-on-write (`adopt`)

    def layout(self) -> list[list]:
        """Every tensor laid out in the file, in order: [byte offset, dtype, shape]. Two files of the same
        layout and size hold the same tensors at the same places."""
        return [
            [tensor.data_ptr() - self.base, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
            for region in self.regions
            for tensor in region._tensors
        ]

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s data lies in this file's mapping."""
        return self.base <= tensor.data_ptr() < self.base + self.size

    def adopt(self, descriptor: int) -> bool:
        """Map the file open at `descriptor` (a saved copy of this file: the same size and `layout`) over this
        file's addresses, copy-on-write (module docs): no byte is copied, every tensor keeps its address. False
        (nothing changed) where the system refuses the fixed mapping; the caller then copies."""
        if self.adopted or os.fstat(descriptor).st_size != self.size:
            return False
        if not _map_fixed(self.base, self.size, mmap.MAP_PRIVATE | MAP_NORESERVE, descriptor):
            return False
        _advise(self.map, mmap.MADV_RANDOM, 0, self.size)
        self.adopted = True
        return True

    def settle(self) -> None:
        """Move an adopted file's contents (the save's, and what was written since) into this cache's own file
        and map that shared again, so that pages leave the process after every read as before `adopt`. Every
        tensor keeps its address; the written rows are read once. ArchiveError, one line, on a full disk
        (nothing lost: the adopted mapping stays)."""
        if not self.adopted:
            return
        written = [(region, region.reserved) for region in self.regions]
        self.adopted = False  # `reserve` and `_pwrite` now reach this file
        try:
            for region, reserved in written:
                region.reserved = 0
                region.reserve(reserved, region.capacity)
                for offset, length in region.rows(0, min(reserved, region.capacity)):
                    region._pwrite(memoryview(self.map)[offset : offset + length], offset)
        except ArchiveError:
            self.adopted = True
            raise
        if not _map_fixed(self.base, self.size, mmap.MAP_SHARED, self.descriptor):
            raise ArchiveError(f"cannot map the recall archive {self.path} again; {FIX}")
        _advise(self.map, mmap.MADV_RANDOM, 0, self.size)
        for region in self.regions:
            region.release()

    def reserve(self, offset: int, length: int) -> None:
        """Reserve bytes `offset .. offset + length` of the file on its disk (`posix_fallocate`; where the file
        system cannot, its free space is checked instead), so that no write through the mapping finds the disk
        full (the C step's would end the process with SIGBUS). Raises ArchiveError, one line, when it is.
        Nothing while adopted: the writes then go to private pages, not to a disk."""
        if self.adopted:
            return
        try:
            os.posix_fallocate(self.descriptor, offset, length)
        except OSError as error:
            if error.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                check_free_space(self.path.parent, length)
                return
            raise ArchiveError(
                f"the disk of the recall archive {self.path} is full ({error.strerror}) after "
                f"{offset:,} bytes; free space there, lower --archive-max, or {FIX}"
            ) from None

    def region(self, nbytes: int) -> ArchiveRegion:
        """The next `nbytes` of the file (rounded up to whole OS pages)."""
        start, self._next = self._next, self._next + aligned(nbytes)
        assert self._next <= self.size, "the file was sized for every region"
        self.regions.append(ArchiveRegion(self, start, self._next))
        return self.regions[-1]

    def close(self) -> None:
        """Remove the file now (unless kept); the mapping goes when its last tensor does."""
        self._finalizer()
        self._closer()


def _advise(mapping: mmap.mmap, advice: int, start: int, length: int) -> bool:
    """`madvise` of a read hint; False (reads as before) on a system without it. The file is read at random
    (`MADV_RANDOM`: a fault past the page cache reads its own page, not the readahead around it; the page
    choice reads thousands of scattered 4 KiB pages a chunk; docs/recall.md, the archive's memory)."""
    with contextlib.suppress(AttributeError, OSError):
        mapping.madvise(advice, start, length)
        return True
    return False


def _map_fixed(address: int, size: int, sharing: int, descriptor: int) -> bool:
    """mmap(2) `size` bytes of the file open at `descriptor` at `address` (MAP_FIXED: replacing what was
    mapped there), read-write, `sharing` (MAP_SHARED or MAP_PRIVATE). False where the system refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    integer = ctypes.c_int
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, integer, integer, integer, ctypes.c_long]
    placed = libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, sharing | MAP_FIXED, descriptor, 0)
    return placed == address


class ArchiveRegion:
    """Bytes `start .. end` of an `ArchiveFile`: tensors laid out in it, and `release()` of its pages."""

    def __init__(self, file: ArchiveFile, start: int, end: int) -> None:
        # No cycle with the file's list of regions: the file goes with its cache, not at a later collection.
        self._file, self.start, self.end = weakref.ref(file), start, end
        self._next = start
        self._tensors: list[torch.Tensor] = []  # what `take` laid out, each [n, rows, ...]
        self.reserved = 0  # the ring slots whose rows are reserved on disk so far (`reserve`)
        self.capacity = 1  # the ring's slots (told by `reserve` and `resume`)
        self.resumed_at = 0  # tokens held when the file was adopted: later ones are in private pages
        self._gaps: tuple[int, list[tuple[int, int]]] = (-1, [])  # (reserved, what `release` drops then)
        self._ahead = False  # `read_ahead` holds until `release`

    @property
    def file(self) -> ArchiveFile:
        """The file the region lies in (alive while its cache is)."""
        file = self._file()
        if file is None:
            raise ArchiveError(
                "the recall archive was closed with its cache; this cache can no longer be used"
            )
        return file

    def resume(self, tokens: int, capacity: int) -> None:
        """The region holds a ring of `capacity` slots with `tokens` written (a saved read put back): in an
        adopted file, the rows of later tokens are the private ones `release` keeps."""
        self.capacity, self.resumed_at, self._gaps = capacity, tokens, (-1, [])
        self.reserved = 0 if not self.file.adopted else tokens

    def rows(self, first: int, last: int):
        """(file offset, bytes) of the rows of ring slots `first .. last - 1` (0 <= first <= last <= capacity)
        in every tensor `take` laid out, head by head: a tensor of `rows` rows holds `rows / capacity` of a row
        per slot (the K/V and scales one, the summaries one per block)."""
        for tensor in self._tensors:
            heads, rows = tensor.shape[0], tensor.shape[1]
            row = tensor[0, 0].nbytes
            begin, end = first * rows // self.capacity, -(-last * rows // self.capacity)
            start = tensor.data_ptr() - self.file.base
            for head in range(heads):
                if end > begin:
                    yield start + (head * rows + begin) * row, (end - begin) * row

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over the next bytes of the region (zero until written)."""
        count = math.prod(shape)
        offset = -(-self._next // 8) * 8  # every dtype's alignment
        self._next = offset + count * dtype.itemsize
        assert self._next <= self.end, "the region was sized for its tensors"
        tensor = torch.frombuffer(self.file.map, dtype=dtype, count=count, offset=offset).view(shape)
        self._tensors.append(tensor)
        return tensor

    def fits(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether `take(shape, dtype)` still has room in the region."""
        return -(-self._next // 8) * 8 + math.prod(shape) * dtype.itemsize <= self.end

    def reserve(self, tokens: int, capacity: int, ahead: int = 0) -> None:
        """Reserve on disk the rows (axis 1) of every tensor `take` laid out that the ring's first `tokens`
        (and `ahead` more) of `capacity` slots span, in every head (axis 0) (`rows`). Raises ArchiveError
        (`ArchiveFile.reserve`) when the disk is full. In an adopted file, only counts `tokens`: private pages
        need no disk, and past `SETTLE_TOKENS` of them the file settles into its own (`ArchiveFile.settle`)."""
        self.capacity = capacity
        if self.file.adopted:
            self.reserved = max(self.reserved, tokens)
            if self.reserved - self.resumed_at > SETTLE_TOKENS:
                self.file.settle()
            return
        tokens = min(tokens + ahead, capacity)
        if tokens <= self.reserved:
            return
        for tensor in self._tensors:
            heads, rows = tensor.shape[0], tensor.shape[1]
            row = tensor[0, 0].nbytes
            begin, end = self.reserved * rows // capacity, -(-tokens * rows // capacity)
            start = tensor.data_ptr() - self.file.base
            for head in range(heads):
                self.file.reserve(start + (head * rows + begin) * row, (end - begin) * row)
        self.reserved = tokens

    def write(self, target: torch.Tensor, first: int, data: torch.Tensor) -> None:
        """Write `data` [n, count, ...] into slots `first .. first + count - 1` (modulo `capacity`) of a
        region tensor `target` [n, capacity, ...] through the file (`os.pwrite`): the pages go to the page
        cache, never into the process (storing through the mapping faults every page in, and is far slower)."""
        capacity, count = target.shape[1], data.shape[1]
        assert count <= capacity and data.shape[0] == target.shape[0]
        row = target[0, 0].nbytes
        offset = target.data_ptr() - self.file.base
        data = data.to(target.dtype).contiguous()
        start = first % capacity
        runs = [(0, min(count, capacity - start), start)]  # (from, to) in data, its first slot
        if runs[0][1] < count:
            runs.append((runs[0][1], count, 0))
        if self.file.adopted:  # into the private pages: the save's file is never written
            for begin, end, slot in runs:
                target[:, slot : slot + end - begin] = data[:, begin:end]
            return
        for head in range(data.shape[0]):
            for begin, end, slot in runs:
                piece = memoryview(data[head, begin:end].view(torch.uint8).numpy()).cast("B")
                self._pwrite(piece, offset + (head * capacity + slot) * row)

    def _pwrite(self, piece: memoryview, offset: int) -> None:
        """`os.pwrite` of every byte of `piece` at `offset` (a write may take part of them). Raises
        ArchiveError naming the folder and the fix (a full disk: one line, not a bare OSError)."""
        try:
            write_all(self.file.descriptor, piece, offset)
        except OSError as error:
            raise ArchiveError(
                f"cannot write the recall archive {self.file.path} ({error.strerror or error}); {FIX}"
            ) from None

    def read_ahead(self) -> None:
        """The next read takes every page in order (a question's score): faults read ahead (`MADV_SEQUENTIAL`:
        a million tokens' keys 6x faster past the page cache than page by page) until `release` puts random
        reads back."""
        self._ahead = _advise(self.file.map, mmap.MADV_SEQUENTIAL, self.start, self.end - self.start)

    def release(self) -> None:
        """Drop the region's pages from the process's resident set (their data stays in the file); in an
        adopted file, every page but those of the tokens written since (`resume`), which live nowhere else."""
        if self._ahead:
            self._ahead = not _advise(self.file.map, mmap.MADV_RANDOM, self.start, self.end - self.start)
        if not self.file.adopted:
            self.file.map.madvise(mmap.MADV_DONTNEED, self.start, self.end - self.start)
            return
        if self._gaps[0] != self.reserved:
            self._gaps = (self.reserved, self._unwritten())
        for begin, end in self._gaps[1]:
            self.file.map.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def _unwritten(self) -> list[tuple[int, int]]:
        """The page-aligned byte ranges of the region that hold no row written since the resume."""
        written = self.reserved - self.resumed_at
        if written >= self.capacity:
            return []
        first = self.resumed_at % self.capacity
        runs = [(first, min(self.capacity, first + written))]
        if first + written > self.capacity:
            runs.append((0, first + written - self.capacity))
        kept = sorted(
            (offset // ALIGN * ALIGN, aligned(offset + length))
            for begin, end in runs
            for offset, length in self.rows(begin, end)
        )
        gaps, at = [], self.start
        for begin, end in kept + [(self.end, self.end)]:
            if begin > at:
                gaps.append((at, begin))
            at = max(at, end)
        return gaps
