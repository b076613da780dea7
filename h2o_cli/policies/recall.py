"""Recall: `h2o` on a resident share of the budget, plus slots refilled from an archive at every step.

The resident set S is managed exactly as `h2o` with budget `budget - recall_slots`; the archive of every token
(`h2o_cli.cache.recall.archive`) and the recall step live in the cache (`RecallLayer`), which asks this policy for its sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from h2o_cli.cache.recall.limits import (
    DEFAULT_ARCHIVE_MAX,
    archive_capacity,
    check_recall_options,
    recall_layer_list,
    recall_lead_head,
)
from h2o_cli.errors import UsageError
from h2o_cli.policies.base import split_slots
from h2o_cli.policies.h2o import HeavyHitterPolicy


@dataclass(frozen=True)
class RecallPolicy(HeavyHitterPolicy):
    name: ClassVar[str] = "recall"
    recalls: ClassVar[bool] = True

    recall_ratio: float = 0.75
    page_size: int = 16
    block_size: int | None = None
    shortlist: int = 512
    step_shortlist: int = 0
    page_carry: float = 0.9
    chunk_weight: float = 8.0
    choice_tokens: int = 32
    archive_max: int | str = DEFAULT_ARCHIVE_MAX
    page_score: str = "attention"
    recall_place: str = "index"
    recall_layers: str = "all"
    recall_lead: str = "auto"
    lead_pages: int | str = 8
    lead_next: int = 1
    lead_outliers: float = 100.0
    lead_text: bool = True

    def __post_init__(self) -> None:
        check_recall_options(
            self.recall_ratio,
            self.page_size,
            self.archive_max,
            page_score=self.page_score,
            block_size=self.block_size,
            shortlist=self.shortlist,
            page_carry=self.page_carry,
            chunk_weight=self.chunk_weight,
            choice_tokens=self.choice_tokens,
            step_shortlist=self.step_shortlist,
            recall_place=self.recall_place,
            recall_layers=self.recall_layers,
            recall_lead=self.recall_lead,
            lead_pages=self.lead_pages,
            lead_next=self.lead_next,
            lead_outliers=self.lead_outliers,
        )
        super().__post_init__()
        split_slots(self.resident, self.heavy_ratio)

    @property
    def recall_slots(self) -> int:
        """Slots per KV head refilled from the archive at every step: `round(budget * recall_ratio)`, less what
        keeps 2 resident (a budget of a few tokens, as a fraction of a short prompt gives, recalls less)."""
        return max(0, min(round(self.budget * self.recall_ratio), self.budget - 2))

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

    def kept_tokens(self, span: int) -> int:
        return self.resident

    def score_distances(self, rolling: bool, chunk: int, tokens: int) -> tuple[int, int] | None:
        """The distances `[low, high)` from a chunk's queries to a recalled key that `--page-score positional`
        averages a page's score over; None for `unrotated` (docs/spec.md, recall).

        A candidate is older than every entry of the recent window (h2o keeps the newest `recent_slots`
        tokens), so at least that many entries of E_q lie between it and a query. Under rolling positions
        E_q has at most `budget + chunk` entries, so every distance is below that; under original positions
        below `tokens`, the tokens seen with the chunk."""
        if self.page_score == "unrotated":
            return None  # `positional` and `attention` score with the rotated query
        high = self.budget + chunk if rolling else tokens
        return min(self.recent_slots, high - 1), high

    def recalling_layers(self, n_layers: int) -> tuple[int, ...]:
        """The layers (of `n_layers`) that recall, ascending: `--recall-layers` (default all). The others hold
        S alone: `h2o` with budget `resident` (what a recalling layer is with R empty), and no archive."""
        return recall_layer_list(self.recall_layers, n_layers)

    @property
    def lead_auto(self) -> bool:
        """Whether `--recall-lead` is `auto` (the model's calibrated head, where it can lead)."""
        return self.recall_lead.strip().lower() == "auto"

    @property
    def lead_calibrated(self) -> bool:
        """Whether `--recall-lead auto` would take the model's calibrated head: pages are ranked by carried
        attention (`--page-score attention`, `--page-carry` above 0)."""
        return self.lead_auto and self.page_score == "attention" and bool(self.page_carry)

    def lead_head(
        self, n_layers: int, n_kv_heads: int, calibrated: tuple[int, int] | None, model: str
    ) -> tuple[int, int] | None:
        """The (layer, KV head) of `--recall-lead` for a model of `n_layers` layers and `n_kv_heads` KV heads
        (`calibrated`: the model's own, for `auto`), or None; it must be a recalling layer. `auto` names none
        where pages are not ranked by carried attention (`--page-score`, `--page-carry 0`) or its layer does
        not recall."""
        if self.lead_auto and (
            not self.lead_calibrated
            or calibrated is None
            or calibrated[0] not in self.recalling_layers(n_layers)
        ):
            return None
        lead = recall_lead_head(self.recall_lead, n_layers, n_kv_heads, calibrated, model)
        if lead is not None and lead[0] not in self.recalling_layers(n_layers):
            raise UsageError(
                f"--recall-lead {self.recall_lead}: layer {lead[0]} does not recall (--recall-layers "
                f"{self.recall_layers}); name a recalling layer's head or add the layer"
            )
        return lead

    def archive_tokens(self, span: int | None, page_bytes: int | None = None) -> int:
        """Archive capacity in tokens (`archive_capacity` of this policy's cap and pages)."""
        return archive_capacity(self.archive_max, self.page_size, span, page_bytes)
