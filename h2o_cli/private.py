"""Where h2o keeps its files (`h2o_home`), and files holding a user's text (chat transcripts, input history,
the recall archive): 0600 in 0700 folders, as shell history is.

Modes are set explicitly, not left to the umask: a transcript is private whatever the umask says. A file is
rewritten by writing a new one beside it and renaming it over the old (`write_private`), so a full disk, a
second Ctrl-C or a crash during a save leaves the previous version whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

from h2o_cli.errors import H2OError

FOLDER_MODE = 0o700
FILE_MODE = 0o600
FULL = (errno.ENOSPC, errno.EDQUOT)  # the errors a full disk (or quota) gives


def h2o_home() -> Path:
    """`$H2O_HOME`, by default `~/.cache/h2o`: converted models, the recall archive, the chat history."""
    return Path(os.environ.get("H2O_HOME", Path.home() / ".cache" / "h2o"))


def private_folder(path: str | Path) -> Path:
    """Create `path` (and missing parents) and make the folder itself 0700."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
    os.chmod(path, FOLDER_MODE)
    return path


def private_file(path: str | Path) -> Path:
    """Create `path` empty if missing, and make it 0600 (an existing file keeps its content)."""
    path = Path(path)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE))
    os.chmod(path, FILE_MODE)
    return path


def write_private(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` with mode 0600 (a missing folder is made 0700), atomically: into a new
    file in the same folder, synced, then renamed over `path`. Raises H2OError naming the file (the disk
    full, say); then, as after an interrupt, `path` keeps its previous content and nothing is left beside it."""
    path = Path(path)
    if not path.parent.exists():
        private_folder(path.parent)
    aside = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        descriptor = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            os.fchmod(descriptor, FILE_MODE)  # the umask may have taken bits from O_CREAT's mode
            write_all(descriptor, text.encode("utf-8"))
            os.fsync(descriptor)  # the data before the rename: a crash then finds the new text, not nothing
        finally:
            os.close(descriptor)
        os.replace(aside, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(aside)
        if isinstance(error, OSError):
            fix = "free some space or save elsewhere" if error.errno in FULL else "save elsewhere"
            raise H2OError(
                f"cannot write {path} ({error.strerror or error}); it keeps its previous content: {fix}"
            ) from None
        raise
    return path


def write_all(descriptor: int, data, offset: int | None = None) -> None:
    """`os.write` (at the file's position) or `os.pwrite` at `offset` until every byte of `data` (any buffer)
    is written: a write may take only part of them, and one that takes nothing is a full disk (ENOSPC)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(descriptor, view) if offset is None else os.pwrite(descriptor, view, offset)
        if written <= 0:  # a write that takes nothing will never finish
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]
        offset = None if offset is None else offset + written


def claim_private(folder: Path, stem: str, suffix: str) -> Path:
    """A new empty 0600 file `folder/stem + suffix` (or `stem-2 + suffix`, `-3`, ... when taken), created
    exclusively: two callers, in one process or two, never get the same name."""
    private_folder(folder)
    for number in range(1, 10_000):
        path = folder / f"{stem}{f'-{number}' if number > 1 else ''}{suffix}"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
        except FileExistsError:
            continue
        os.chmod(path, FILE_MODE)
        return path
    raise H2OError(f"{folder} holds 10,000 files named {stem}*{suffix}; remove some")
