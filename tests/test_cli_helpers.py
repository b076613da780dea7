"""Small CLI helpers built on rich: byte sizes and progress over a file."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import Progress

from h2o_cli.cli.common import size
from h2o_cli.cli.stream import _tracked
from h2o_cli.textio import text_blocks


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1,023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (13.4 * 2**20, "13.4 MiB"),
        (2**30 - 1, "1,024.0 MiB"),  # one byte short of a GiB: still MiB (rounded for display)
        (5 * 2**30, "5.0 GiB"),
        (3 * 2**40, "3.0 TiB"),
    ],
)
def test_sizes_in_binary_units(nbytes, text):
    assert size(nbytes) == text


def test_progress_counts_every_byte_read_from_a_file():
    raw = ("word " * 40 + "\n").encode() * 500  # ~100 KB: several 64 KiB blocks
    with Progress(console=Console(file=io.StringIO()), disable=True) as progress:
        task = progress.add_task("read", total=len(raw))
        reader = _tracked(progress, task, io.BytesIO(raw), len(raw))
        text = "".join(text_blocks(reader, name="book"))
        assert text == raw.decode()
        assert progress.tasks[0].completed == len(raw) and progress.tasks[0].finished


def test_stdin_has_no_size_and_is_read_as_is():
    stdin = io.BytesIO(b"text\n")
    with Progress(console=Console(file=io.StringIO()), disable=True) as progress:
        task = progress.add_task("read", total=None)
        assert _tracked(progress, task, stdin, None) is stdin
