"""TOVA (Oren et al. 2024): evict the entry the chunk's last query attended to least (no accumulation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_cli.policies.base import SlotState, protect_recent


@dataclass(frozen=True)
class TovaPolicy:
    recent: int
    name: str = "tova"
    evicts: bool = True

    def priority(self, state: SlotState) -> torch.Tensor:
        return protect_recent(state.last_probs, state, self.recent)
