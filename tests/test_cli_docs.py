"""docs/cli.md must be what scripts/gen_cli_docs.py generates from the current --help texts."""

from __future__ import annotations

import importlib.util

from conftest import REPO


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", REPO / "scripts" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_md_matches_help():
    generator = _generator()
    expected = generator.render()
    assert "## h2o chat" in expected and "Examples:" in expected
    current = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert current == expected, "docs/cli.md is stale: run python scripts/gen_cli_docs.py"
