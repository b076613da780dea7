"""Eviction policies: one file each, built from `CacheSettings` here."""

from __future__ import annotations

from h2o_cli.config import CacheSettings
from h2o_cli.policies.base import select_evictions
from h2o_cli.policies.full import FullPolicy
from h2o_cli.policies.h2o import HeavyHitterPolicy
from h2o_cli.policies.local import LocalPolicy
from h2o_cli.policies.sink import SinkPolicy
from h2o_cli.policies.tova import TovaPolicy

POLICY_BUILDERS = {
    "h2o": lambda s: HeavyHitterPolicy(recent=s.recent, score_norm=s.score_norm),
    "local": lambda s: LocalPolicy(),
    "sink": lambda s: SinkPolicy(sinks=s.sinks),
    "tova": lambda s: TovaPolicy(recent=s.recent),
    "full": lambda s: FullPolicy(),
}


def make_policy(settings: CacheSettings):
    """The policy object for `settings.policy`."""
    return POLICY_BUILDERS[settings.policy](settings)


__all__ = ["make_policy", "select_evictions", "POLICY_BUILDERS"]
