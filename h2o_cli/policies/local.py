"""Sliding window: evict the oldest entry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_cli.policies.base import Policy, SlotState, protect_recent


@dataclass(frozen=True)
class LocalPolicy(Policy):
    name: ClassVar[str] = "local"

    def priority(self, state: SlotState) -> torch.Tensor:
        # Every valid entry ties; the tie rule (oldest first) makes it a window.
        return protect_recent(torch.zeros_like(state.scores), state, 0)
