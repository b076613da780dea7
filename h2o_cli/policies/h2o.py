"""H2O (Zhang et al. 2023): evict the smallest accumulated attention outside the recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_cli.errors import UsageError
from h2o_cli.policies.base import Policy, SlotState, protect_recent, split_slots

SCORE_NORMS = ("sum", "mean")


@dataclass(frozen=True)
class HeavyHitterPolicy(Policy):
    name: ClassVar[str] = "h2o"

    heavy_ratio: float = 0.5
    score_norm: str = "sum"

    def __post_init__(self) -> None:
        super().__post_init__()
        split_slots(self.budget, self.heavy_ratio)
        if self.score_norm not in SCORE_NORMS:
            raise UsageError(f"--score-norm {self.score_norm!r} is unknown; choose sum or mean")

    @property
    def heavy_slots(self) -> int:
        return split_slots(self.budget, self.heavy_ratio)

    @property
    def kernel_victim(self) -> bool:
        # The decode kernel compares raw accumulated sums; the mean needs the seen-counts.
        return self.score_norm == "sum"

    def priority(self, state: SlotState) -> torch.Tensor:
        scores = state.scores
        if self.score_norm == "mean":
            # kvpress's fix for the sum's bias to old tokens: average over the queries that saw each token.
            scores = scores / state.seen.clamp_min(1)
        return protect_recent(scores, state, self.recent_slots)
