"""What may open a saved read (h2o_cli.saved): the checks a resume makes (the model, the settings) and the
lock a process that will write a save again holds (`SaveLock`). Each refusal is one line (`H2OError`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from h2o_cli.config import CacheSettings
from h2o_cli.errors import H2OError
from h2o_cli.private import FILE_MODE, private_folder
from h2o_cli.saved import SavedRead

# Settings that change nothing a resumed cache computes (where it runs, where its archive lives): a resume
# may change them; any other setting must be the saved one.
FREE_SETTINGS = ("kernels", "decode_threads", "archive", "keep_archive")


def resume_settings(saved: SavedRead, given: dict) -> CacheSettings:
    """The settings to resume `saved` with: the saved ones, where `given` (the options set on the command
    line, by field) may change only `FREE_SETTINGS`. Raises H2OError naming the first other setting given
    with another value than the saved one."""
    settings = dict(saved.settings)
    for name, value in given.items():
        if name in FREE_SETTINGS:
            settings[name] = value
            continue
        wanted = CacheSettings(**{**settings, name: value}).resolved(_window(settings))
        if getattr(wanted, name) != settings[name]:
            option = "--" + name.replace("_", "-")
            raise H2OError(
                f"the save {saved.path} was made with {option} {settings[name]}, not {value}; resume it without "
                f"{option}, or read the text again"
            )
    return CacheSettings(**settings)


def _window(settings: dict) -> int:
    """A context window to resolve a changed setting against (a fractional budget is refused anyway: the
    saved budget is a whole number of tokens)."""
    return max(int(settings["budget"]) + int(settings["chunk"]), 1) * 4


def check_model(saved: SavedRead, model: dict) -> None:
    """Raise H2OError naming the difference unless the model `model` (`model_identity`) is the saved one."""
    want = saved.manifest["model"]
    for key, what in (("quant", "--quant"), ("dtype", "--dtype")):
        if want.get(key) != model.get(key):
            raise H2OError(
                f"the save {saved.path} was made with {what} {want.get(key)}, not {model.get(key)}; resume it "
                f"with {what} {want.get(key)}"
            )
    if want.get("fingerprint") != model.get("fingerprint"):
        raise H2OError(
            f"the save {saved.path} was made with model {want.get('name')} ({want.get('fingerprint', '')[:12]}),"
            f" not {model.get('name')} ({model.get('fingerprint', '')[:12]}); resume it with --model "
            f"{want.get('name')}"
        )


class SaveLock:
    """An exclusive lock on a save for a process that will write it again (`flock` on `.NAME.lock` beside
    it, 0600): a second such process is refused in one line; the lock goes with the process (even SIGKILL)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path).expanduser().absolute()
        folder = private_folder(path.parent) if not path.parent.exists() else path.parent
        self.file = folder / f".{path.name}.lock"
        self.descriptor = os.open(self.file, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(self.descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.descriptor, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.descriptor)
            raise H2OError(
                f"the save {path} is open for writing by another h2o (pid {holder}); end that one first, or "
                "resume it with h2o stream --resume, which only reads"
            ) from None
        os.ftruncate(self.descriptor, 0)
        os.pwrite(self.descriptor, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.descriptor)
