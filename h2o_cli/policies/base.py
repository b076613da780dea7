"""What every eviction policy sees, and the shared tie rule."""

from __future__ import annotations

from typing import Protocol

import torch

NEVER = float("inf")


class SlotState(Protocol):
    """Per-layer slot state a policy reads (all `[n_kv_heads, slots]`; `length` entries are valid per head)."""

    valid: torch.Tensor
    token_index: torch.Tensor
    rank: torch.Tensor
    scores: torch.Tensor
    seen: torch.Tensor
    last_probs: torch.Tensor
    length: int


def protect_recent(priority: torch.Tensor, state: SlotState, recent: int) -> torch.Tensor:
    """Make the `recent` newest entries of each head (by token index) never-evict."""
    if recent > 0:
        priority = priority.masked_fill(state.rank >= state.length - recent, NEVER)
    return priority.masked_fill(~state.valid, NEVER)


def select_evictions(priority: torch.Tensor, token_index: torch.Tensor, count: int) -> torch.Tensor:
    """Slots to evict per head: the `count` lowest priorities, ties to the oldest token.

    priority, token_index: [n_kv_heads, slots]. Returns [n_kv_heads, count] slot indices.
    """
    if count == 1:
        # Decode step: one min per head, then the oldest among equal minima. No sort. Empty slots
        # (token_index -1) never qualify, even when every valid priority is NEVER.
        empty = token_index < 0
        lowest = priority.masked_fill(empty, NEVER).min(dim=1, keepdim=True).values
        candidates = (priority == lowest) & ~empty
        oldest = torch.where(candidates, token_index, torch.iinfo(torch.int64).max)
        return oldest.argmin(dim=1, keepdim=True)
    # Lexicographic (priority, token_index): order by age, then a stable sort by priority keeps age order in ties.
    by_age = torch.argsort(torch.where(token_index < 0, torch.iinfo(torch.int64).max, token_index), dim=1)
    by_priority = torch.argsort(priority.gather(1, by_age), dim=1, stable=True)
    return by_age.gather(1, by_priority[:, :count])
