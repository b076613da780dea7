"""H2O (Zhang et al. 2023): evict the smallest accumulated attention outside the recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_cli.policies.base import SlotState, protect_recent


@dataclass(frozen=True)
class HeavyHitterPolicy:
    recent: int
    score_norm: str = "sum"
    name: str = "h2o"
    evicts: bool = True

    def priority(self, state: SlotState) -> torch.Tensor:
        scores = state.scores
        if self.score_norm == "mean":
            # kvpress's fix for the sum's bias to old tokens: average over the queries that saw each token.
            scores = scores / state.seen.clamp_min(1)
        return protect_recent(scores, state, self.recent)
