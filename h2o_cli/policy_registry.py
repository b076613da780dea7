"""Policy names -> policy classes: the one registry, kept outside the policy modules so that `CacheSettings`
can check a name and a policy's parameters without importing them (the policies depend on the settings,
never the reverse).

Each policy class registers itself here when `h2o_cli.policies` is imported; importing the `h2o_cli` package
does that, and Python runs the package before any of its modules (`h2o_cli.config` included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from h2o_cli.errors import UsageError

if TYPE_CHECKING:
    from h2o_cli.config import CacheSettings
    from h2o_cli.policies.base import Policy

REGISTRY: dict[str, type[Policy]] = {}


def register(policy: type[Policy]) -> type[Policy]:
    """Make a policy class known by its `name` (to `CacheSettings`, the CLI's choices, `make_policy`)."""
    REGISTRY[policy.name] = policy
    return policy


def policy_class(name: str) -> type[Policy]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UsageError(f"--policy {name!r} is unknown; choose one of {', '.join(REGISTRY)}") from None


def policy_names() -> tuple[str, ...]:
    """Names of the registered policies."""
    return tuple(REGISTRY)


def make_policy(settings: CacheSettings) -> Policy:
    """The policy object for `settings.policy` (settings with `budget` in tokens); it checks its parameters."""
    return policy_class(settings.policy).from_settings(settings)


__all__ = ["REGISTRY", "make_policy", "policy_class", "policy_names", "register"]
