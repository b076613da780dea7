"""Full cache: never evicts, so positions are the original ones and the window is the model's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_cli.policies.base import NEVER, Policy, SlotState


@dataclass(frozen=True)
class FullPolicy(Policy):
    """Keeps every token of its span (the budget is not used): exact attention, limited by the context window."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False
    positions: ClassVar[tuple[str, ...]] = ("original",)

    @property
    def recent_slots(self) -> int:
        return self.budget

    def kept_tokens(self, span: int) -> int:
        return span

    def priority(self, state: SlotState) -> torch.Tensor:
        return torch.full_like(state.scores, NEVER)
