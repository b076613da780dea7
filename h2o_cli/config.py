"""Cache settings as plain data, and the budget rules of SPEC.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

from h2o_cli.errors import UsageError

POLICIES = ("h2o", "local", "sink", "tova", "full")
POSITIONS = ("rolling", "original")
SCORE_NORMS = ("sum", "mean")


def parse_budget(value: str | float, context_tokens: int) -> int:
    """Turn `--budget` into a token count `k` (SPEC.md: fraction of `context_tokens` or absolute count)."""
    try:
        budget = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"--budget {value!r} is not a number; give a fraction like 0.1 or a token count like 512")
    if math.isnan(budget) or math.isinf(budget) or budget <= 0:
        raise UsageError(f"--budget {value} must be > 0: a fraction in (0, 1] or a token count > 1")
    if budget <= 1:
        tokens = round(budget * context_tokens)
        if tokens < 2:
            raise UsageError(
                f"--budget {value} is {tokens} token(s) of a {context_tokens}-token context; "
                "give a larger fraction or a token count of at least 2"
            )
        return tokens
    if budget != int(budget):
        raise UsageError(f"--budget {value} above 1 must be a whole token count, e.g. {int(budget)}")
    return int(budget)


@dataclass(frozen=True)
class CacheSettings:
    """What a cache keeps. `budget` is the token count `k` each KV head keeps after every step.

    `chunk` is the most tokens one forward call adds; the slot buffers hold `budget + chunk` entries so a
    chunk never reallocates.
    """

    budget: int
    policy: str = "h2o"
    heavy_ratio: float = 0.5
    sinks: int = 4
    positions: str = "rolling"
    score_norm: str = "sum"
    chunk: int = 256

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise UsageError(f"--policy {self.policy!r} is unknown; choose one of {', '.join(POLICIES)}")
        if self.positions not in POSITIONS:
            raise UsageError(f"--positions {self.positions!r} is unknown; choose rolling or original")
        if self.score_norm not in SCORE_NORMS:
            raise UsageError(f"--score-norm {self.score_norm!r} is unknown; choose sum or mean")
        if self.budget < 2:
            raise UsageError(f"budget of {self.budget} tokens is too small; keep at least 2 tokens per head")
        if not 0 <= self.heavy_ratio <= 1:
            raise UsageError(f"--heavy-ratio {self.heavy_ratio} must lie in [0, 1]")
        if self.chunk < 1:
            raise UsageError(f"--chunk {self.chunk} must be at least 1")
        if self.policy == "sink" and not 0 <= self.sinks < self.budget:
            raise UsageError(f"--sinks {self.sinks} must be >= 0 and smaller than the budget ({self.budget})")

    @property
    def heavy(self) -> int:
        """Slots for heavy hitters (`h2o`, `tova`); sink tokens for `sink`; 0 for window policies."""
        if self.policy in ("h2o", "tova"):
            return round(self.budget * self.heavy_ratio)
        if self.policy == "sink":
            return self.sinks
        return 0

    @property
    def recent(self) -> int:
        """Slots for the newest tokens."""
        return self.budget - self.heavy
