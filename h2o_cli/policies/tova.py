"""TOVA (Oren et al. 2024): evict the entry the chunk's last query attended to least (no accumulation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_cli.policies.base import Policy, SlotState, protect_recent, split_slots


@dataclass(frozen=True)
class TovaPolicy(Policy):
    name: ClassVar[str] = "tova"

    heavy_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        split_slots(self.budget, self.heavy_ratio)

    @property
    def heavy_slots(self) -> int:
        return split_slots(self.budget, self.heavy_ratio)

    def priority(self, state: SlotState) -> torch.Tensor:
        return protect_recent(state.last_probs, state, self.recent_slots)
