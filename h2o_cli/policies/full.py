"""Full cache: never evicts; bounded by the model's context window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_cli.policies.base import NEVER, SlotState


@dataclass(frozen=True)
class FullPolicy:
    name: str = "full"
    evicts: bool = False

    def priority(self, state: SlotState) -> torch.Tensor:
        return torch.full_like(state.scores, NEVER)
