"""The CPU decode steps as C functions (`decode_step.c` for `h2o`, `recall_step.c` for `recall`, sharing
`step_common.h`), built on first use with the system's C compiler.

A decode step of a full cache is ~40 tiny tensor ops per layer on the torch path; each costs microseconds of
dispatch, so on a CPU the bookkeeping, not the arithmetic, is what a step pays for (docs/benchmarks.md). The C
function does the same steps in one call. It is built once per source, compiler and CPU into
`$H2O_HOME/kernels/` (`cc -O3 -march=native`, a second or two) and loaded with ctypes, so it needs no Python
headers, no build at install time, and nothing but a C compiler. Without one, or if the build fails, the torch
path runs: quietly under `--kernels auto`, with one warning line under `--kernels native`.
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
SOURCES = (FOLDER / "decode_step.c", FOLDER / "recall_step.c")  # compiled together into one library
HEADERS = (FOLDER / "step_common.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
ENV_CC = "CC"
logger = logging.getLogger("h2o_kernels")

# The store's buffers the C function takes, in its argument order.
STORE_BUFFERS = ("keys", "values", "scores", "seen", "last_probs", "token_index", "rank", "valid")

_INT, _PTR, _FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
ARGTYPES = [_INT] * 5 + [_PTR] * 12 + [_INT] * 4 + [_FLOAT] + [_PTR] * 3
# recall_step.c: `recall_choose` and `recall_decode_step` (h2o_decode_step's arguments, then R's).
CHOOSE_ARGTYPES = [_INT] * 4 + [_PTR] * 2 + [_INT] * 4 + [_PTR] * 4 + [_INT] + [_PTR] * 9
ARCHIVE_ARGTYPES = [_INT] * 5 + [_PTR] * 6
RECALL_ARGTYPES = ARGTYPES[:22] + [_INT] + [_PTR] * 4 + [_INT] + [_PTR] * 4


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


def build(folder: Path | None = None) -> Path:
    """The shared library for these sources, compiler and CPU, compiled unless already there. Raises
    `RuntimeError` (no compiler) or `subprocess.CalledProcessError` (the compiler failed)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC)")
    texts = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        b"\0".join([*texts, " ".join(FLAGS).encode(), cc.encode(), cpu_signature().encode()])
    )
    folder = folder or cache_folder()
    target = folder / f"h2o_decode_step-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:  # built aside, then renamed: no torn library
        built = Path(scratch) / target.name
        subprocess.run(
            [cc, *FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(built, target)
    return target


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded step function (built on the first call of the process; raises as `build`)."""
    lib = ctypes.CDLL(str(build()))
    lib.h2o_decode_step.argtypes = ARGTYPES
    lib.h2o_decode_step.restype = _INT
    lib.h2o_exp_nonpositive.argtypes = [_PTR, _PTR, _INT]  # its e**x, for the accuracy test
    lib.h2o_exp_nonpositive.restype = None
    lib.recall_choose.argtypes = CHOOSE_ARGTYPES
    lib.recall_choose.restype = _INT
    lib.recall_decode_step.argtypes = RECALL_ARGTYPES
    lib.recall_decode_step.restype = _INT
    lib.recall_archive_token.argtypes = ARCHIVE_ARGTYPES
    lib.recall_archive_token.restype = None
    return lib


def failure_text(error: BaseException) -> str:
    """One line saying why the library is unusable (a compiler's first error line, not its whole log)."""
    if isinstance(error, subprocess.CalledProcessError):
        lines = [line for line in (error.stderr or "").splitlines() if "error" in line] or [str(error)]
        return f"the C compiler failed: {lines[0].strip()}"
    return f"{type(error).__name__}: {error}".splitlines()[0]


@functools.cache
def available(explicit: bool = False) -> bool:
    """Whether the C step can run in this process. The first failure is logged once: as a warning when
    the C step was asked for (`--kernels native`), at info level under `auto`."""
    try:
        library()
    except Exception as error:  # no compiler, a compile error, a library the loader refuses
        level = logging.WARNING if explicit else logging.INFO
        logger.log(level, "C decode step unavailable (%s); using the torch path", failure_text(error))
        return False
    return True


def store_pointers(store) -> tuple[int, ...]:
    """The addresses of a float32 CPU store's buffers (`STORE_BUFFERS`), in the C steps' argument order: they
    never move, so they are taken once per store."""
    buffers = [getattr(store, name) for name in STORE_BUFFERS]
    assert all(tensor.is_contiguous() and tensor.device.type == "cpu" for tensor in buffers)
    assert store.keys.dtype == torch.float32
    return tuple(tensor.data_ptr() for tensor in buffers)


def step_scratch(store, group: int, recall: int = 0) -> torch.Tensor:
    """The C step's float scratch: `group` rows of probabilities over S and `recall` slots, one key row and
    the query halves (recall_decode_step's layout)."""
    return torch.empty(group * (store.slots + recall) + (group + 1) * store.head_dim, dtype=torch.float32)


def stepped(store, active: int, step: str) -> None:
    """Take a C step's result into the store's counters, or raise if the step refused the store's state."""
    if active < 0:
        raise RuntimeError(f"C {step} step refused the store's state (code {active})")
    store.stepped(active)


class StepBuffers:
    """The fixed arguments of one store's C step: its buffers' addresses and scratch."""

    def __init__(self, store, group: int) -> None:
        self.store = store
        self.pointers = store_pointers(store)
        self.scratch = step_scratch(store, group)
        self.victims = torch.empty(store.n_kv_heads, dtype=torch.int64)


def decode_step(
    buffers: StepBuffers,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    rolling: bool,
    limit: int,
    decay: float,
) -> torch.Tensor:
    """Run the C step on `buffers.store` (see decode_step.c for the contract) and update its counters.

    query: [n_kv_heads, group, 2 * head_dim] (`h2o_cli.cache.step.expand` form, scaled); key, value:
    [n_kv_heads, 1, head_dim] unrotated; table: `Rope.step_table`. Returns the output
    [n_kv_heads, group, head_dim] float32."""
    store = buffers.store
    n_kv, group, width = query.shape
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    output = torch.empty(n_kv, group, store.head_dim, dtype=torch.float32)
    active = library().h2o_decode_step(
        n_kv, group, store.head_dim, store.slots, store.active,
        query.data_ptr(), key.data_ptr(), value.data_ptr(), table.data_ptr(),
        *buffers.pointers,
        int(rolling), store.tokens_seen, store.length, limit, decay,
        output.data_ptr(), buffers.scratch.data_ptr(), buffers.victims.data_ptr(),
    )  # fmt: skip
    stepped(store, active, "decode")
    return output


class RecallBuffers:
    """The fixed arguments of one `RecallLayer`'s C step: the store's (`StepBuffers`), its archive's and
    recall slots' addresses, and scratch (the archive is a float32 ring in RAM: its buffers never move)."""

    def __init__(self, layer) -> None:
        store, archive = layer.store, layer.archive
        self.store_pointers = store_pointers(store)
        self.victims = torch.empty(store.n_kv_heads, dtype=torch.int64)
        self.group = 0  # query heads per KV head the scratch is sized for (at the first step)
        assert archive.region is None and archive.keys.dtype == torch.float32
        tensors = (archive.token_index, archive.keys, archive.values)
        tensors += (layer.recall_keys, layer.recall_values, layer.recall_index)
        assert all(tensor.is_contiguous() for tensor in tensors)
        self.layer = layer
        self.archive_pointers = tuple(tensor.data_ptr() for tensor in tensors[:3])
        self.recall_pointers = tuple(tensor.data_ptr() for tensor in tensors[3:])
        recall, slots = layer.recall_index.shape[1], store.slots
        self.candidate = torch.empty(archive.capacity, dtype=torch.uint8)
        self.previous = torch.full((archive.capacity,), -1, dtype=torch.int64)  # -1 between calls
        self.pages = torch.empty(archive.pages, 2, dtype=torch.int64)
        self.chosen = torch.empty(max(recall, 1), dtype=torch.int64)
        self.counts = torch.zeros(store.n_kv_heads, dtype=torch.int64)
        self.totals = (ctypes.c_int64 * 2)()  # read without a tensor op: recalled, the most of one head
        self.summary_pointer = archive.summary.data_ptr()
        self.order = torch.empty(2 * slots + 3 * recall, dtype=torch.int64)
        self.scratch = torch.empty(0, dtype=torch.float32)

    def for_group(self, group: int) -> RecallBuffers:
        """Size the step's buffers for `group` query heads per KV head (once)."""
        if self.group != group:
            self.scratch = step_scratch(self.layer.store, group, self.layer.recall_index.shape[1])
            self.group = group
        return self


def archive_token(buffers: RecallBuffers, key: torch.Tensor, value: torch.Tensor) -> None:
    """`PageArchive.write` of one token (recall_step.c): key, value [n_kv_heads, 1, head_dim] unrotated."""
    archive = buffers.layer.archive
    key, value = key.contiguous(), value.contiguous()
    library().recall_archive_token(
        archive.n_kv_heads, archive.head_dim, archive.capacity, archive.page_size, archive.tokens,
        key.data_ptr(), value.data_ptr(), *buffers.archive_pointers, buffers.summary_pointer,
    )  # fmt: skip
    archive.tokens += 1


def recall_choose(buffers: RecallBuffers, bound: torch.Tensor) -> tuple[int, int]:
    """Pass 1 of a one-token recall step (recall_step.c): from the page bounds on, `PageArchive.choose_one`
    and the read into the recall slots, for the token the step is about to write (`store.tokens_seen`, already
    archived). bound: [n_kv_heads, used pages] float32 (`best_page_bound`). Returns (tokens recalled, hits),
    summed over KV heads; `buffers.counts` holds each head's, `buffers.totals[1]` the most of one head."""
    layer = buffers.layer
    store, archive = layer.store, layer.archive
    bound = bound.contiguous()
    used = bound.shape[1]
    hits = library().recall_choose(
        store.n_kv_heads, store.head_dim, store.slots, store.active,
        store.token_index.data_ptr(), store.valid.data_ptr(), store.tokens_seen,
        archive.capacity, archive.page_size, used,
        *buffers.archive_pointers, bound.data_ptr(), layer.recall_index.shape[1], *buffers.recall_pointers,
        buffers.candidate.data_ptr(), buffers.previous.data_ptr(), buffers.pages.data_ptr(),
        buffers.chosen.data_ptr(), buffers.counts.data_ptr(), buffers.totals,
    )  # fmt: skip
    return buffers.totals[0], hits


def recall_step(
    buffers: RecallBuffers,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    rolling: bool,
    limit: int,
    decay: float,
    entries: int,
) -> torch.Tensor:
    """Pass 2 of a one-token recall step (recall_step.c) after `recall_choose`: `decode_step` over S and the
    recall slots (`entries`: the query's position + 1 with rolling positions). Returns the output
    [n_kv_heads, group, head_dim] float32 and updates the store's counters."""
    layer = buffers.layer
    store = layer.store
    n_kv, group, _ = query.shape
    buffers = buffers.for_group(group)
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    output = torch.empty(n_kv, group, store.head_dim, dtype=torch.float32)
    active = library().recall_decode_step(
        n_kv, group, store.head_dim, store.slots, store.active,
        query.data_ptr(), key.data_ptr(), value.data_ptr(), table.data_ptr(),
        *buffers.store_pointers,
        int(rolling), store.tokens_seen, store.length, limit, decay,
        layer.recall_index.shape[1], *buffers.recall_pointers, buffers.counts.data_ptr(), entries,
        output.data_ptr(), buffers.scratch.data_ptr(), buffers.order.data_ptr(), buffers.victims.data_ptr(),
    )  # fmt: skip
    stepped(store, active, "recall")
    return output
