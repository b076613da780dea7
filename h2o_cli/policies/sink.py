"""StreamingLLM (Xiao et al. 2023): keep the first `sinks` tokens of the stream, then a sliding window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_cli.policies.base import NEVER, SlotState, protect_recent


@dataclass(frozen=True)
class SinkPolicy:
    sinks: int = 4
    name: str = "sink"
    evicts: bool = True

    def priority(self, state: SlotState) -> torch.Tensor:
        priority = torch.zeros_like(state.scores).masked_fill(state.token_index < self.sinks, NEVER)
        return protect_recent(priority, state, 0)
