"""h2o: H2O (Heavy-Hitter Oracle) KV-cache eviction with rolling positions, for long contexts in fixed memory."""

import h2o_cli.policies  # noqa: F401  registers the built-in policies, which CacheSettings checks names against
from h2o_cli.cache.attention import enable
from h2o_cli.cache.model_cache import H2OCache
from h2o_cli.config import CacheSettings, parse_budget

__version__ = "0.1.0"

__all__ = ["H2OCache", "CacheSettings", "enable", "parse_budget", "__version__"]
