"""Budget rules and settings checks of SPEC.md."""

from __future__ import annotations

import pytest

from h2o_cli.config import CacheSettings, parse_budget, split_run_specs
from h2o_cli.errors import UsageError


@pytest.mark.parametrize(
    ("value", "context", "tokens"),
    [
        ("0.1", 8192, 819),
        ("1", 8192, 8192),
        ("512", 8192, 512),
        (0.5, 10, 5),
        ("2", 100, 2),
        ("20000", 8192, 20000),
    ],
)
def test_budget_values(value, context, tokens):
    assert parse_budget(value, context) == tokens


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "abc", "", "0.0001", "1.5", "-0.2"])
def test_bad_budgets_are_usage_errors(value):
    with pytest.raises(UsageError) as error:
        parse_budget(value, 8192)
    assert "--budget" in str(error.value) and "\n" not in str(error.value)


def test_split_heavy_recent():
    settings = CacheSettings(budget=101, heavy_ratio=0.5)
    assert settings.heavy + settings.recent == 101
    assert CacheSettings(budget=10, policy="local").recent == 10
    assert CacheSettings(budget=10, policy="sink", sinks=4).heavy == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(budget=1),
        dict(budget=10, policy="nope"),
        dict(budget=10, positions="absolute"),
        dict(budget=10, heavy_ratio=1.5),
        dict(budget=10, chunk=0),
        dict(budget=4, policy="sink", sinks=4),
        dict(budget=10, score_norm="max"),
    ],
)
def test_settings_reject_nonsense(kwargs):
    with pytest.raises(UsageError):
        CacheSettings(**kwargs)


def test_budget_plus_chunk_must_fit_the_window_with_rolling_positions(tiny_pair):
    """SPEC: rolling positions reach budget + chunk - 1; past the window (256 here) the cache refuses."""
    from h2o_cli.cache import H2OCache

    _, model = tiny_pair
    with pytest.raises(UsageError, match=r"--chunk 6 or less, or --budget 240 or less"):
        H2OCache(model, CacheSettings(budget=250, chunk=16))
    assert H2OCache(model, CacheSettings(budget=240, chunk=16)).stores[0].slots == 256  # exactly fits
    H2OCache(model, CacheSettings(budget=250, chunk=16), span=200)  # never given more than 200 tokens
    H2OCache(model, CacheSettings(budget=250, chunk=16, positions="original"))  # checked per token instead


def test_settings_resolve_a_fraction_against_their_window():
    settings = CacheSettings(budget="0.1", chunk=32)
    assert settings.budget == 0.1 and not settings.is_resolved
    assert settings.resolved(8192).budget == 819 and settings.resolved(8192).is_resolved
    assert CacheSettings(budget="512").resolved(100).budget == 512  # a count stays a count
    with pytest.raises(UsageError, match="--budget"):
        settings.resolved(10)  # 1 token
    assert settings.resolved(10, floor=True).budget == 2


def test_lm_eval_model_args_map_onto_the_same_fields():
    settings = CacheSettings.from_args(
        budget="0.3", policy="sink", sinks="2", kv_bits="8", chunk="64", batch_size="1"
    )
    assert settings == CacheSettings(budget=0.3, policy="sink", sinks=2, kv_bits=8, chunk=64)
    assert CacheSettings.from_args(budget="0.2", kv_bits="None").kv_bits is None


def test_every_cache_option_is_one_settings_field():
    """A new cache flag is one CacheSettings field plus one line in CACHE_OPTIONS; commands get it from there."""
    import dataclasses
    import inspect

    from h2o_cli.cli import chat, compare, options, stream
    from h2o_cli.cli import eval as eval_cmd

    assert list(options.CACHE_OPTIONS) == [field.name for field in dataclasses.fields(CacheSettings)]
    for command, skipped in (
        (chat.chat, ()),
        (stream.stream, ()),
        (eval_cmd.eval, ("policy",)),
        (compare.compare, ("budget", "policy")),
    ):
        offered = set(inspect.signature(command).parameters)
        assert {name for name in options.CACHE_OPTIONS if name not in skipped} <= offered, command.__name__


def test_a_policy_made_in_code_has_the_settings_defaults():
    """A policy's fields repeat `CacheSettings`' (`from_settings` copies them by name), so one made directly,
    without settings, must default as a command does: e.g. `RecallPolicy(budget=…).lead_text` is True."""
    import dataclasses

    from h2o_cli.policy_registry import policy_class, policy_names

    settings = {field.name: field for field in dataclasses.fields(CacheSettings)}
    compared = 0
    for name in policy_names():
        for field in dataclasses.fields(policy_class(name)):
            assert field.name in settings, f"{name}.{field.name} has no setting to come from"
            if field.default is not dataclasses.MISSING:
                assert field.default == settings[field.name].default, f"{name}.{field.name}"
                compared += 1
    assert compared >= 15  # recall's own fields alone are more


@pytest.mark.parametrize(
    ("value", "specs"),
    [
        ("full,h2o", ["full", "h2o"]),
        ("recall:recall_ratio=0.5,lead_pages=4", ["recall:recall_ratio=0.5,lead_pages=4"]),
        ("full,recall:recall_layers=6,17,sink", ["full", "recall:recall_layers=6,17", "sink"]),
        ("recall:lead_text=0;recall", ["recall:lead_text=0", "recall"]),
    ],
)
def test_run_specs_split_where_a_policy_name_starts_one(value, specs):
    assert split_run_specs(value) == specs
    for spec in specs:  # and each is a whole spec
        CacheSettings.from_spec(spec, budget=64)
