"""`--help` groups options into panels a person can hold: the command's own first (at most 10 options), the
common path in the first panels, recall's tuning knobs together in "Advanced recall"."""

from __future__ import annotations

import dataclasses
import re

import pytest

PANEL = re.compile(r"^╭─ (.+?) ─")
OPTION = re.compile(r"^│ (--[a-z0-9-]+)")


def panels(command: str) -> dict[str, list[str]]:
    """The option panels of `h2o COMMAND --help`, in the order printed: title -> long option names."""
    from typer.testing import CliRunner

    from h2o_cli.cli.app import app

    env = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb", "FORCE_COLOR": None}
    result = CliRunner().invoke(app, [command, "--help"], env=env, terminal_width=200)
    assert result.exit_code == 0, result.output
    found: dict[str, list[str]] = {}
    title = None
    for line in result.output.splitlines():
        if match := PANEL.match(line):
            title = match.group(1)
            found[title] = []
        elif title is not None and (match := OPTION.match(line)):
            found[title].append(match.group(1))
    found.pop("Arguments", None)
    return found


def recall_only_settings() -> set[str]:
    """The settings only `recall` reads (its policy's fields that no other policy has): its tuning knobs."""
    from h2o_cli.policy_registry import policy_class, policy_names

    def names(policy: str) -> set[str]:
        return {field.name for field in dataclasses.fields(policy_class(policy))}

    others = set().union(*(names(policy) for policy in policy_names() if policy != "recall"))
    return names("recall") - others


def flag(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def test_stream_help_shows_panels_with_a_short_first_one():
    shown = panels("stream")
    assert {"Options", "Cache", "Model", "Output", "Speed / kernels", "Advanced recall"} <= set(shown)
    first = next(iter(shown.values()))
    assert 0 < len(first) <= 10, first
    # the common path (read a file, its perplexity or a question, policy, budget, model, JSON) sits in the
    # first four panels and needs at most 10 options
    common = ["--sample", "--ppl", "--max-tokens", "--prompt", "--policy", "--budget", "--model", "--json"]
    up_front = [name for title in list(shown)[:4] for name in shown[title]]
    assert set(common) <= set(up_front) and len(common) <= 10
    assert sum(map(len, shown.values())) > 40  # every option is still offered


@pytest.mark.parametrize("command", ["stream", "chat", "eval", "compare"])
def test_every_recall_tuning_knob_sits_in_the_advanced_panel(command):
    knobs = recall_only_settings()
    assert {"page_carry", "chunk_weight", "choice_tokens", "step_shortlist", "lead_pages"} <= knobs
    shown = panels(command)
    assert set(shown["Advanced recall"]) == {flag(name) for name in knobs}
    assert list(shown)[-1] == "Advanced recall"
    first = next(iter(shown.values()))
    assert not {flag(name) for name in knobs} & set(first)


def test_every_cache_setting_is_offered_once_in_one_panel():
    from h2o_cli.config import CacheSettings

    shown = panels("stream")
    offered = [name for names in shown.values() for name in names]
    assert len(offered) == len(set(offered))
    assert {flag(field.name) for field in dataclasses.fields(CacheSettings)} <= set(offered)
