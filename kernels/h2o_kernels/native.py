"""The C twins of the CPU decode step (`step.c`: the one-token step over S ∪ R, `h2o`'s the case R = ∅;
`archive.c`: `recall`'s archive write and page choice, wrapped by `native_archive.py`; `read.c`: a bf16 read's rotations and softmax, wrapped by
`native_read.py`; sharing `step_common.h`), built on first use with the
system's C compiler, and thin typed wrappers that take tensors, addresses and sizes (never a cache object: the
cache side, h2o_cli/cache/c_step.py, holds the buffers and keeps the counters).

A decode step of a full cache is ~40 tiny tensor ops per layer on the torch path; each costs microseconds of
dispatch, so on a CPU the bookkeeping, not the arithmetic, is what a step pays for (docs/benchmarks.md). The C
function does the same steps in one call. It is built once per source, compiler and CPU into
`$H2O_HOME/kernels/` (`cc -O3 -march=native`, a second or two) and loaded with ctypes, so it needs no Python
headers, no build at install time, and nothing but a C compiler. Without one, or if the build fails, the torch
path runs: quietly under `--kernels auto`, with one warning line under `--kernels native`.

Loading a library runs its code, so only one that nobody else could have written is loaded: the folder is
made (and kept) 0700, the library built is its owner's alone, and a library found there that belongs to
another user or that group or others may write is refused (`UnsafeLibraryError`: one warning line naming it
and the fix, whatever `--kernels` says, and the torch path runs).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

FOLDER = Path(__file__).parent
SOURCES = (FOLDER / "step.c", FOLDER / "archive.c", FOLDER / "read.c")  # compiled together into one library
HEADERS = (FOLDER / "step_common.h",)
# -fno-trapping-math: nothing here reads the floating-point exception flags, and without it GCC leaves the
# softmax's e**x loops (`exp_nonpositive`, a clamp then bit work) scalar; the arithmetic and its rounding are unchanged.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared",
         "-std=c11")  # fmt: skip
ENV_CC = "CC"
logger = logging.getLogger("h2o_kernels")

_INT, _PTR, _FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# step.c's `cache_step`: sizes, the call's inputs, the store's 8 buffers, the step's scalars, R's, the outputs,
# the pinned entries.
STEP_ARGTYPES = [_INT] * 5 + [_PTR] * 12 + [_INT] * 4 + [_FLOAT] + [_INT] + [_PTR] * 5 + [_INT] + [_PTR] * 4
# archive.c: `archive_choose`, `archive_lead_choose` and `archive_tokens`.
CHOOSE_ARGTYPES = [_INT] * 4 + [_PTR] * 2 + [_INT] * 4 + [_PTR] * 4 + [_INT] + [_PTR] * 11
LEAD_ARGTYPES = [_INT] * 4 + [_PTR] * 2 + [_INT] * 4 + [_PTR] * 4 + [_INT] * 3 + [_PTR] * 12
TOKENS_ARGTYPES = [_INT] * 7 + [_PTR] * 6
SCORES_ARGTYPES = [_INT] * 7 + [ctypes.c_float] * 2 + [_INT] + [_PTR] * 14
NO_RECALL = (0, None, None, None, None, None)  # `step`'s recall arguments for R = ∅


def cache_folder() -> Path:
    """Where built libraries are kept: `$H2O_HOME/kernels` (`~/.cache/h2o/kernels` by default, as the
    models: `h2o_cli.models.sources.home`)."""
    return Path(os.environ.get("H2O_HOME") or Path.home() / ".cache" / "h2o") / "kernels"


def cpu_signature() -> str:
    """What `-march=native` depends on: the machine and its CPU's feature flags (a library built for one
    CPU may use instructions another lacks, and `$H2O_HOME` may be shared between machines)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def compiler() -> str | None:
    return os.environ.get(ENV_CC) or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


class UnsafeLibraryError(RuntimeError):
    """A library (or its folder) that another user could have written: never loaded."""


def check_owned(path: Path) -> None:
    """Raises `UnsafeLibraryError`, naming `path` and the fix, unless it belongs to this user and neither
    group nor others may write it."""
    status = os.stat(path)
    if status.st_uid != os.geteuid():
        problem = f"{path} belongs to another user (uid {status.st_uid})"
    elif status.st_mode & 0o022:
        problem = f"{path} is writable by group or others (mode {status.st_mode & 0o777:o})"
    else:
        return
    raise UnsafeLibraryError(
        f"refusing {problem}; remove it (h2o builds its own again) or set $H2O_HOME to a folder of yours"
    )


def owned_folder(folder: Path) -> Path:
    """`folder` (and its parents as needed), made 0700; an existing one of this user's is made 0700 too.
    Raises `UnsafeLibraryError` for one of another user's."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    status = os.stat(folder)
    if status.st_uid != os.geteuid():
        raise UnsafeLibraryError(
            f"refusing the library folder {folder}: it belongs to another user; set $H2O_HOME to a folder of yours"
        )
    if status.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder


def library_path(folder: Path | None = None) -> Path:
    """Where the library for these sources, compiler and CPU lives in `folder` (`cache_folder()`). Raises
    `RuntimeError` if there is no compiler."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC)")
    texts = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        b"\0".join([*texts, " ".join(FLAGS).encode(), cc.encode(), cpu_signature().encode()])
    )
    return (folder or cache_folder()) / f"h2o_steps-{key.hexdigest()[:16]}.so"


def build(folder: Path | None = None) -> Path:
    """The shared library for these sources, compiler and CPU, compiled unless already there, in a 0700
    folder and writable by its owner only. Raises `RuntimeError` (no compiler), `UnsafeLibraryError` (a
    folder of another user's) or `subprocess.CalledProcessError` (the compiler failed)."""
    target = library_path(folder)
    owned_folder(target.parent)
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(
        dir=target.parent
    ) as scratch:  # built aside, then renamed: no torn library
        built = Path(scratch) / target.name
        subprocess.run(
            [compiler(), *FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.chmod(
            built, 0o700
        )  # not the umask's: a group-writable umask must not make h2o refuse its own build
        os.replace(built, target)
    return target


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded step function (built on the first call of the process; raises as `build`, and
    `UnsafeLibraryError` for a library that others could have written)."""
    path = build()
    check_owned(path)
    lib = ctypes.CDLL(str(path))
    lib.cache_step.argtypes = STEP_ARGTYPES
    lib.cache_step.restype = _INT
    lib.h2o_exp_nonpositive.argtypes = [_PTR, _PTR, _INT]  # its e**x, for the accuracy test
    lib.h2o_exp_nonpositive.restype = None
    lib.archive_choose.argtypes = CHOOSE_ARGTYPES
    lib.archive_choose.restype = _INT
    lib.archive_lead_choose.argtypes = LEAD_ARGTYPES
    lib.archive_lead_choose.restype = _INT
    lib.archive_tokens.argtypes = TOKENS_ARGTYPES
    lib.archive_tokens.restype = None
    lib.archive_step_scores.argtypes = SCORES_ARGTYPES
    lib.archive_step_scores.restype = None
    lib.archive_held_bytes.argtypes = []
    lib.archive_held_bytes.restype = _INT
    return lib


@functools.cache
def has_step_scores() -> bool:
    """Whether this build has `archive_step_scores`: its compiler has half precision (GCC 12+, clang 15+), the
    type the step holds its shortlist's keys in."""
    return library().archive_held_bytes() == 2


def failure_text(error: BaseException) -> str:
    """One line saying why the library is unusable (a compiler's first error line, not its whole log)."""
    if isinstance(error, subprocess.CalledProcessError):
        lines = [line for line in (error.stderr or "").splitlines() if "error" in line] or [str(error)]
        return f"the C compiler failed: {lines[0].strip()}"
    return f"{type(error).__name__}: {error}".splitlines()[0]


@functools.cache
def available(explicit: bool = False) -> bool:
    """Whether the C step can run in this process. The first failure is logged once: as a warning when
    the C step was asked for (`--kernels native`) or the library was refused as unsafe, at info level under
    `auto` otherwise."""
    try:
        library()
    except Exception as error:  # no compiler, a compile error, an unsafe library, one the loader refuses
        level = logging.WARNING if explicit or isinstance(error, UnsafeLibraryError) else logging.INFO
        logger.log(
            level,
            "C kernels (decode step, read softmax) unavailable (%s); using the torch path",
            failure_text(error),
        )
        return False
    return True


def step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    store: tuple[int, ...],
    slots: int,
    active: int,
    rolling: int,
    tokens_seen: int,
    length: int,
    limit: int,
    decay: float,
    scratch: torch.Tensor,
    victims: torch.Tensor,
    recall: tuple = NO_RECALL,
    entries: int | None = None,
    pinned: int | None = None,
) -> tuple[torch.Tensor, int]:
    """One layer's one-token step (step.c's `cache_step`, which states the contract): write, attention over S
    and the recall slots, S's scores, one eviction, in the store's buffers.

    query: [n_kv_heads, group, 2 * head_dim] (`h2o_cli.cache.step.expand` form, scaled); key, value:
    [n_kv_heads, 1, head_dim] unrotated; table: `Rope.step_table`, all float32. store: the addresses of the
    store's keys, values [n_kv_heads, slots, head_dim], scores, seen, last_probs [n_kv_heads, slots] (float32),
    token_index, rank (int64) and valid (bool), in that order; `active`, `tokens_seen`, `length` its counters.
    scratch: float32, [group * (slots + r) + (group + 1) * head_dim] at least; victims: int64 [n_kv_heads].
    rolling: 0 token indices, 1 rolling positions, 2 rolling with R placed before the recent window (step.c).
    recall: `NO_RECALL`, or (r, the addresses of the recall keys, values [n_kv_heads, r, head_dim], their token
    indices [n_kv_heads, r], each head's count [n_kv_heads] and an int64 scratch [2 * slots + 3 * r]).
    entries: the query's position + 1 under rolling positions (default `length + 1`, R = ∅).
    pinned: the address of a bool [n_kv_heads, slots] of entries never evicted, or None (none pinned).
    Returns the output [n_kv_heads, group, head_dim] float32 and the store's new `active`; raises RuntimeError
    if the step refused the store's state."""
    n_kv, group, width = query.shape
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    output = torch.empty(n_kv, group, width // 2, dtype=torch.float32)
    active = library().cache_step(
        n_kv, group, width // 2, slots, active,
        query.data_ptr(), key.data_ptr(), value.data_ptr(), table.data_ptr(),
        *store,
        int(rolling), tokens_seen, length, limit, decay,
        *recall, length + 1 if entries is None else entries,
        output.data_ptr(), scratch.data_ptr(), victims.data_ptr(), pinned,
    )  # fmt: skip
    if active < 0:
        raise RuntimeError(f"the C step refused the store's state (code {active})")
    return output, active
