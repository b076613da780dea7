"""Eviction policies: one file each, known by name through the registry here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from h2o_cli.policies.base import REGISTRY, Policy, policy_class, register, select_evictions
from h2o_cli.policies.full import FullPolicy
from h2o_cli.policies.h2o import HeavyHitterPolicy
from h2o_cli.policies.local import LocalPolicy
from h2o_cli.policies.recall import RecallPolicy
from h2o_cli.policies.sink import SinkPolicy
from h2o_cli.policies.tova import TovaPolicy

if TYPE_CHECKING:
    from h2o_cli.config import CacheSettings

# The registry: one line per policy (its order is the order of the CLI's choices).
for _policy in (HeavyHitterPolicy, LocalPolicy, SinkPolicy, TovaPolicy, FullPolicy, RecallPolicy):
    register(_policy)


def policy_names() -> tuple[str, ...]:
    """Names of the registered policies."""
    return tuple(REGISTRY)


def make_policy(settings: CacheSettings) -> Policy:
    """The policy object for `settings.policy` (settings with `budget` in tokens)."""
    return policy_class(settings.policy).from_settings(settings)


__all__ = ["Policy", "make_policy", "policy_class", "policy_names", "register", "select_evictions"]
