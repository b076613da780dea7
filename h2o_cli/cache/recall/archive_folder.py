"""Where the `recall` archive's files go: their names (`--archive disk`, a folder or a file), the free space a
file needs, and the files of runs that are gone (a run killed outright leaves its file; the next archive made
in the same folder removes it)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

from h2o_cli.errors import ArchiveError
from h2o_cli.private import h2o_home

ARCHIVE_FOLDER = "archive"  # under $H2O_HOME
SUFFIX = ".kv"
OWNED = re.compile(r"recall-(\d{1,10})-[0-9a-f]{8}\.kv")  # files this module names (not the kept ones)
PID_LIMIT = 2**31  # a process id is a positive C int
FIX = "use --archive ram, or a folder with room with --archive PATH"


def archive_location(where: str, keep: bool = False) -> Path:
    """The file for `--archive disk` (a fresh name in `$H2O_HOME/archive/`) or `--archive PATH`: a folder (one
    that exists, or a path ending in `/`) gets a fresh name inside, anything else is the file itself."""
    if where == "disk":
        folder = h2o_home() / ARCHIVE_FOLDER
    elif where.endswith(("/", os.sep)) or Path(where).expanduser().is_dir():
        folder = Path(where).expanduser()
    else:
        return Path(where).expanduser()
    kind = "kept" if keep else str(os.getpid())
    return folder / f"recall-{kind}-{secrets.token_hex(4)}{SUFFIX}"


def unlink_unless(path: Path, keep: bool) -> None:
    """Remove the file at `path` (if it is there) unless it is `keep`t."""
    if not keep:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def check_free_space(folder: Path, size: int) -> None:
    """Raises ArchiveError, naming `folder` and the fix, unless its file system has `size` bytes free."""
    status = os.statvfs(folder)
    free = status.f_bavail * status.f_frsize
    if free < size:
        raise ArchiveError(
            f"the recall archive needs {size:,} bytes in {folder}, which has {free:,} free; lower "
            f"--archive-max, or {FIX}"
        )


def remove_stale(folder: Path) -> None:
    """Remove archive files this module named in `folder` whose process no longer runs (a killed run's);
    a name whose PID no process can have is not one of them, and is left alone."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            owner = OWNED.fullmatch(entry.name)
            pid = int(owner[1]) if owner else 0
            if not 0 < pid < PID_LIMIT or pid == os.getpid():
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
            except PermissionError:
                pass  # alive, another user's
