"""The CPU decode step as one C function (`decode_step.c`), built on first use with the system's C compiler.

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

SOURCE = Path(__file__).with_name("decode_step.c")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
ENV_CC = "CC"
logger = logging.getLogger("h2o_kernels")

# The store's buffers the C function takes, in its argument order.
STORE_BUFFERS = ("keys", "values", "scores", "seen", "last_probs", "token_index", "rank", "valid")

_INT, _PTR, _FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
ARGTYPES = [_INT] * 5 + [_PTR] * 12 + [_INT] * 4 + [_FLOAT] + [_PTR] * 3


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
    """The shared library for this source, compiler and CPU, compiled unless already there. Raises
    `RuntimeError` (no compiler) or `subprocess.CalledProcessError` (the compiler failed)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), cc.encode(), cpu_signature().encode()])
    )
    folder = folder or cache_folder()
    target = folder / f"h2o_decode_step-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:  # built aside, then renamed: no torn library
        built = Path(scratch) / target.name
        subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
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


class StepBuffers:
    """The fixed arguments of one store's C step: its buffers' addresses (they never move) and scratch."""

    def __init__(self, store, group: int) -> None:
        buffers = [getattr(store, name) for name in STORE_BUFFERS]
        assert all(tensor.is_contiguous() and tensor.device.type == "cpu" for tensor in buffers)
        assert store.keys.dtype == torch.float32
        self.store = store
        self.scratch = torch.empty(
            group * (store.slots + 1) + (group + 1) * store.head_dim, dtype=torch.float32
        )
        self.victims = torch.empty(store.n_kv_heads, dtype=torch.int64)
        self.pointers = tuple(tensor.data_ptr() for tensor in buffers)


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

    query: [n_kv_heads, group, 2 * head_dim] (`h2o_cli.decode_step.expand` form, scaled); key, value:
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
    if active < 0:
        raise RuntimeError(f"C decode step refused the store's state (code {active})")
    store.stepped(active)
    return output
