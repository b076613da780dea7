"""Where h2o keeps its files (`h2o_home`), and files holding a user's text (chat transcripts, input history,
the recall archive): 0600 in 0700 folders, as shell history is.

Modes are set explicitly, not left to the umask: a transcript is private whatever the umask says.
"""

from __future__ import annotations

import os
from pathlib import Path

FOLDER_MODE = 0o700
FILE_MODE = 0o600


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
    """Write `text` (UTF-8) to `path`, created or truncated with mode 0600; a missing folder is made 0700."""
    path = Path(path)
    if not path.parent.exists():
        private_folder(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # O_CREAT's mode applies only to a new file
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
    return path
