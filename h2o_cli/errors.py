"""Typed errors. The CLI boundary turns each into one red line on stderr and an exit code."""


class H2OError(Exception):
    """A problem the user can fix; the message names the problem and the fix. Exit code 1."""

    exit_code = 1


class UsageError(H2OError):
    """A bad option value or combination. Exit code 2, like argument parsing errors."""

    exit_code = 2


class ModelNotFoundError(H2OError):
    """The weights of a model are not on this machine and cannot be fetched."""


class UnsupportedModelError(H2OError):
    """The model family cannot run with the H2O cache (no rotary positions, unknown attention layout)."""


class InputError(H2OError):
    """The text to read is missing, empty, a directory, or not UTF-8."""


class ContextOverflowError(H2OError):
    """A cache that never evicts (or original positions) ran past the model's context window."""


class ArchiveError(H2OError):
    """The `recall` archive's file cannot be created or its space reserved (`--archive PATH`)."""
