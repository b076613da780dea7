"""StreamingLLM (Xiao et al. 2023): keep the first `sinks` tokens of the stream, then a sliding window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_cli.errors import UsageError
from h2o_cli.policies.base import NEVER, Policy, SlotState, protect_recent


@dataclass(frozen=True)
class SinkPolicy(Policy):
    name: ClassVar[str] = "sink"

    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.sinks < self.budget:
            raise UsageError(f"--sinks {self.sinks} must be >= 0 and smaller than the budget ({self.budget})")

    @property
    def heavy_slots(self) -> int:
        return self.sinks

    def priority(self, state: SlotState) -> torch.Tensor:
        priority = torch.zeros_like(state.scores).masked_fill(state.token_index < self.sinks, NEVER)
        return protect_recent(priority, state, 0)
