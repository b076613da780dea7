"""Recall (issue 11): `h2o` on a resident share of the budget, plus slots refilled from an archive at every step.

The resident set S is managed exactly as `h2o` with budget `budget - recall_slots`; the archive of every token
(`h2o_cli.archive`) and the recall step live in the cache (`RecallLayer`), which asks this policy for its sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from h2o_cli.errors import UsageError
from h2o_cli.policies.base import split_slots
from h2o_cli.policies.h2o import HeavyHitterPolicy


def check_recall_options(recall_ratio: float, page_size: int, archive_max: int) -> None:
    """One-line usage errors for `--recall-ratio`, `--page-size`, `--archive-max` (whatever the policy)."""
    if not 0 <= recall_ratio <= 1:  # also NaN
        raise UsageError(f"--recall-ratio {recall_ratio} must lie in [0, 1]")
    if page_size < 1:
        raise UsageError(f"--page-size {page_size} must be at least 1")
    if archive_max < 2 * page_size:
        raise UsageError(f"--archive-max {archive_max} must hold at least two pages ({2 * page_size} tokens)")


@dataclass(frozen=True)
class RecallPolicy(HeavyHitterPolicy):
    name: ClassVar[str] = "recall"
    recalls: ClassVar[bool] = True

    recall_ratio: float = 0.5
    page_size: int = 4
    archive_max: int = 16384

    def __post_init__(self) -> None:
        check_recall_options(self.recall_ratio, self.page_size, self.archive_max)
        super().__post_init__()
        if self.resident < 2:
            raise UsageError(
                f"--recall-ratio {self.recall_ratio} leaves {self.resident} resident token(s) of a budget of "
                f"{self.budget}; keep at least 2 (a smaller ratio or a larger budget)"
            )
        split_slots(self.resident, self.heavy_ratio)
        if self.score_decay != 1.0:  # the recall step accumulates plain sums (RecallLayer)
            raise UsageError(
                f"--score-decay {self.score_decay} is not supported with --policy recall yet; drop it, "
                "or use --policy h2o"
            )

    @property
    def recall_slots(self) -> int:
        """Slots per KV head refilled from the archive at every step: `round(budget * recall_ratio)`."""
        return round(self.budget * self.recall_ratio)

    @property
    def resident(self) -> int:
        """|S|: entries kept by `h2o`'s rule (the budget less the recall slots)."""
        return self.budget - self.recall_slots

    @property
    def heavy_slots(self) -> int:
        return split_slots(self.resident, self.heavy_ratio)

    @property
    def recent_slots(self) -> int:
        return self.resident - self.heavy_slots

    @property
    def kernel_victim(self) -> bool:
        return False  # the recall step runs on the torch reference, never the fused decode kernel

    def kept_tokens(self, span: int) -> int:
        return self.resident

    def archive_tokens(self, span: int | None) -> int:
        """Archive capacity in tokens: `archive_max` (at most `span` when known), whole pages, at least two."""
        tokens = min(self.archive_max, span) if span else self.archive_max
        pages = max(2, -(-tokens // self.page_size))
        return pages * self.page_size
