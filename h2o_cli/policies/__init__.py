"""Eviction policies: one file each, known by name through the registry (`h2o_cli.policy_registry`)."""

from __future__ import annotations

from h2o_cli.policies.base import Policy, select_evictions
from h2o_cli.policies.full import FullPolicy
from h2o_cli.policies.h2o import HeavyHitterPolicy
from h2o_cli.policies.local import LocalPolicy
from h2o_cli.policies.recall import RecallPolicy
from h2o_cli.policies.sink import SinkPolicy
from h2o_cli.policies.tova import TovaPolicy
from h2o_cli.policy_registry import make_policy, policy_class, policy_names, register

# One line per policy (its order is the order of the CLI's choices).
for _policy in (HeavyHitterPolicy, LocalPolicy, SinkPolicy, TovaPolicy, FullPolicy, RecallPolicy):
    register(_policy)


__all__ = ["Policy", "make_policy", "policy_class", "policy_names", "register", "select_evictions"]
