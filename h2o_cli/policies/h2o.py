"""H2O (Zhang et al. 2023): evict the smallest accumulated attention outside the recent window.

The defaults are the paper's policy. Two settings vary it: `score_decay` γ < 1 makes scores
forget (õ ← γ·õ + p per query token, docs/spec.md), and `h2o_sinks` keeps the first tokens of the stream
in heavy slots whatever their score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_cli.errors import UsageError
from h2o_cli.policies.base import NEVER, Policy, SlotState, protect_recent, split_slots

SCORE_NORMS = ("sum", "mean")


@dataclass(frozen=True)
class HeavyHitterPolicy(Policy):
    name: ClassVar[str] = "h2o"

    heavy_ratio: float = 0.5
    score_norm: str = "sum"
    score_decay: float = 1.0
    h2o_sinks: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        heavy = split_slots(self.budget, self.heavy_ratio)
        if self.score_norm not in SCORE_NORMS:
            raise UsageError(f"--score-norm {self.score_norm!r} is unknown; choose sum or mean")
        if not (isinstance(self.score_decay, int | float) and 0 < self.score_decay <= 1):
            raise UsageError(f"--score-decay {self.score_decay} must lie in (0, 1]; 1 is the paper's sum")
        if self.score_decay < 1 and self.score_norm != "sum":
            raise UsageError("--score-decay below 1 works with --score-norm sum only")
        if not 0 <= self.h2o_sinks <= heavy:
            raise UsageError(
                f"--h2o-sinks {self.h2o_sinks} must be >= 0 and at most the heavy slots ({heavy} of a "
                f"budget of {self.budget} at --heavy-ratio {self.heavy_ratio})"
            )

    @property
    def heavy_slots(self) -> int:
        return split_slots(self.budget, self.heavy_ratio)

    @property
    def decay_per_query(self) -> float:
        return float(self.score_decay)

    @property
    def kernel_victim(self) -> bool:
        # The decode kernel compares raw accumulated sums (decayed before it runs): no mean, no sinks.
        return self.score_norm == "sum" and self.h2o_sinks == 0

    def priority(self, state: SlotState) -> torch.Tensor:
        scores = state.scores
        if self.score_norm == "mean":
            # kvpress's fix for the sum's bias to old tokens: average over the queries that saw each token.
            scores = scores / state.seen.clamp_min(1)
        if self.h2o_sinks:
            scores = scores.masked_fill(state.token_index < self.h2o_sinks, NEVER)  # like `sink`'s
        return protect_recent(scores, state, self.recent_slots)
