"""What every eviction policy is and sees, and the eviction choice (`select_evictions`).

Policies are known by name through `h2o_cli.policy_registry`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from h2o_kernels.reference import NEVER, OLDEST_LAST, lowest_oldest

from h2o_cli.errors import UsageError

if TYPE_CHECKING:
    from h2o_cli.config import CacheSettings


class SlotState(Protocol):
    """Per-layer slot state a policy reads (all `[n_kv_heads, slots]`; `length` entries are valid per head)."""

    valid: torch.Tensor
    token_index: torch.Tensor
    rank: torch.Tensor
    scores: torch.Tensor
    seen: torch.Tensor
    last_probs: torch.Tensor
    length: int


@dataclass(frozen=True)
class Policy:
    """An eviction policy: a frozen dataclass that decides everything its name means.

    Fields are named after `CacheSettings` fields and filled from them (`from_settings`); `__post_init__`
    checks them. The class constants say what the rest of the code may assume:
    - `evicts`: False for a cache that keeps every token (then it holds its whole span, see `kept_tokens`).
    - `positions`: the `--positions` values it supports; the first is used when another is asked for.
    - `decay_per_query` (property): γ by which the cache multiplies every score per query token (1 = none).
    - `kernel_victim` (property): the fused decode kernel's eviction candidate (the lowest accumulated score
      outside the `recent_slots` newest entries, ties to the oldest) is exactly this policy's choice.
    - `recalls`: the cache archives every token and refills `recall_slots` from it at each step (`recall`).
    """

    name: ClassVar[str]
    evicts: ClassVar[bool] = True
    recalls: ClassVar[bool] = False
    positions: ClassVar[tuple[str, ...]] = ("rolling", "original")

    budget: int

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int):
            raise TypeError(f"a policy needs a budget in tokens, not {self.budget!r}: resolve it first")
        if self.budget < 2:
            raise UsageError(f"budget of {self.budget} tokens is too small; keep at least 2 tokens per head")

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> Policy:
        """The policy for `settings` (its `budget` resolved to tokens): each field from the same-named setting."""
        return cls(**{field.name: getattr(settings, field.name) for field in fields(cls)})

    @property
    def heavy_slots(self) -> int:
        """Slots for entries kept for what they are (heavy hitters, sinks); 0 for window policies."""
        return 0

    @property
    def recent_slots(self) -> int:
        """Slots for the newest entries."""
        return self.budget - self.heavy_slots

    @property
    def kernel_victim(self) -> bool:
        return False

    @property
    def recall_slots(self) -> int:
        """Slots per KV head refilled from an archive at every step (besides the kept entries)."""
        return 0

    @property
    def decay_per_query(self) -> float:
        """γ of accumulated scores: before each query token adds its probabilities, every score is multiplied
        by γ (docs/spec.md). 1.0 (the default): scores only add up, as in the paper."""
        return 1.0

    @classmethod
    def positions_for(cls, asked: str) -> str:
        """The positions a cache with this policy uses when `asked` for some (`rolling` or `original`)."""
        return asked if asked in cls.positions else cls.positions[0]

    def kept_tokens(self, span: int) -> int:
        """Entries each KV head keeps when the cache will be given at most `span` tokens."""
        return self.budget

    def priority(self, state: SlotState) -> torch.Tensor:
        """`[n_kv_heads, slots]`: the lowest is evicted first (ties to the oldest), `inf` = never."""
        raise NotImplementedError


def split_slots(budget: int, heavy_ratio: float) -> int:
    """Heavy-hitter slots of a budget (the rest hold the newest entries); checks `--heavy-ratio`."""
    if not 0 <= heavy_ratio <= 1:
        raise UsageError(f"--heavy-ratio {heavy_ratio} must lie in [0, 1]")
    return round(budget * heavy_ratio)


def protect_recent(priority: torch.Tensor, state: SlotState, recent: int) -> torch.Tensor:
    """Make the `recent` newest entries of each head (by token index) never-evict."""
    if recent > 0:
        priority = priority.masked_fill(state.rank >= state.length - recent, NEVER)
    return priority.masked_fill(~state.valid, NEVER)


# The priority of an entry its policy never evicts once pins leave it nothing else to evict: above every score,
# below `NEVER` (a pinned entry's), so those go first, oldest first (docs/spec.md, pinned tokens).
PROTECTED = torch.finfo(torch.float32).max


def keep_pinned(priority: torch.Tensor, valid: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """A policy's `priority` [n_kv_heads, slots] with pinned entries (`pinned`, bool) never evicted: they take
    `NEVER`, and the entries the policy protects (`NEVER`, valid, unpinned) take `PROTECTED`, so that when
    every unpinned entry is protected the oldest of them goes rather than a pinned one."""
    protected = valid & ~pinned & (priority == NEVER)
    return priority.masked_fill(protected, PROTECTED).masked_fill(pinned, NEVER)


def select_evictions(priority: torch.Tensor, token_index: torch.Tensor, count: int) -> torch.Tensor:
    """Slots to evict per head: the `count` lowest priorities, ties to the oldest token.

    priority, token_index: [n_kv_heads, slots]. Returns [n_kv_heads, count] slot indices.
    """
    if count == 1:  # decode: one min per head, no sort; empty slots (token_index -1) never qualify
        empty = token_index < 0
        return lowest_oldest(priority.masked_fill(empty, NEVER), token_index.masked_fill(empty, OLDEST_LAST))
    # Lexicographic (priority, token_index): order by age, then a stable sort by priority keeps age order in ties.
    by_age = torch.argsort(torch.where(token_index < 0, torch.iinfo(torch.int64).max, token_index), dim=1)
    by_priority = torch.argsort(priority.gather(1, by_age), dim=1, stable=True)
    return by_age.gather(1, by_priority[:, :count])
