"""Sliding window: evict the oldest entry."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_cli.policies.base import SlotState, protect_recent


@dataclass(frozen=True)
class LocalPolicy:
    name: str = "local"
    evicts: bool = True

    def priority(self, state: SlotState) -> torch.Tensor:
        # Every valid entry ties; the tie rule (oldest first) makes it a window.
        return protect_recent(torch.zeros_like(state.scores), state, 0)
