"""The archive of the `recall` policy, as a recalling layer uses it: `PageArchive`, the page choice (which archived
tokens become R, the recalled set) over a scored store, built from the policy's `PageSettings`.

One `PageArchive` per layer, in three parts, each one concern in one file:
- `h2o_cli.cache.recall.store` (`ArchiveStore`): the ring of K/V, the token index, the page summaries, the
  write of a piece and the reads;
- `h2o_cli.cache.recall.scores` (`PageScoring`): the score each choice ranks pages by (`bounds`), the carried
  scores, the shortlist, and the page order (`order_key`);
- here: the choice. `choose` is the rule (the best pages' candidates, in reading order); `choose_one` (a
  one-token step) and `choose_fixed` (the fixed step, fixed shapes) are its one-query forms, pinned to it by
  tests/test_recall_step.py::test_choose_one_is_choose_for_one_query and
  tests/test_fixed_step.py::test_choose_fixed_is_choose (archive.c's `archive_choose` is the C twin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_cli.cache.recall.scores import PageScoring, as_held, best_page_bound, order_key, page_bound
from h2o_cli.cache.recall.store import NOTHING, ArchiveStore

__all__ = [
    "NOTHING",
    "ArchiveStore",
    "PageArchive",
    "PageScoring",
    "PageSettings",
    "as_held",
    "best_page_bound",
    "order_key",
    "page_bound",
]


@dataclass(frozen=True)
class PageSettings:
    """How an archive pages its tokens and scores its pages (docs/spec.md, recall): `page_size` tokens per page,
    summarised in blocks of `block_size` (None: 4 where 4 divides the page, else the page); `attention`, pages
    scored by attention mass (`--page-score attention`), else by the summaries' bound; `shortlist`, `carry`,
    `chunk_weight`, `step_shortlist` as `PageScoring` (`--shortlist`, `--page-carry`, `--chunk-weight`,
    `--step-shortlist`)."""

    page_size: int
    block_size: int | None = None
    attention: bool = False
    shortlist: int = 0
    carry: float = 0.0
    chunk_weight: float = 1.0
    step_shortlist: int = 0

    @classmethod
    def of(cls, policy) -> PageSettings:
        """The page settings of a `recall` policy (`h2o_cli.policies.recall`)."""
        return cls(
            policy.page_size,
            policy.block_size,
            attention=policy.page_score == "attention",
            shortlist=policy.shortlist,
            carry=policy.page_carry,
            chunk_weight=policy.chunk_weight,
            step_shortlist=policy.step_shortlist,
        )


class PageArchive(PageScoring):
    """One layer's archive: `PageScoring` over an `ArchiveStore` (K/V `[n_kv_heads, capacity, head_dim]` in a
    ring, summaries per block and KV head), and the choice of R from it.

    PageArchive(n_kv_heads, head_dim, capacity, settings, dtype, device, bits=None, region=None): `capacity`
    token slots (a whole number, at least 2, of pages), `settings` a `PageSettings`, `dtype` the compute dtype,
    `bits` and `region` the storage (`ArchiveStore`).
    """

    def choose(
        self,
        query: torch.Tensor,
        resident: torch.Tensor,
        before: int,
        slots: int,
        chunk: int = 1,
        question: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick up to `slots` archived tokens per KV head for a chunk's queries (pass 1 of a recall step).

        query: [n_kv_heads, m, head_dim], the chunk's unrotated queries of each KV head's query heads
        (m = group * chunk); resident: [n_kv_heads, n] token indices of S (-1 = empty); `before`: the chunk's
        first token (only older tokens are candidates). A candidate is an archived token older than `before`
        not in S. Pages with a candidate are ranked by their `bounds` score (the max over the m queries of
        `page_bound`, or their attention mass; ties: the older page first, `order_key`); their candidates are taken in that order, oldest first inside a page. `chunk`: the
        chunk's tokens (m / group), which `bounds` weighs with `chunk_weight` when scores are carried;
        `question`: the queries are a question's (`bounds` scores every page for it). Returns archive slots
        [n_kv_heads, slots] and which of them hold a chosen token [n_kv_heads, slots].
        """
        n_kv, device = self.n_kv_heads, self.token_index.device
        archived = (self.token_index != NOTHING) & (self.token_index < before)
        # Resident tokens still in the archive mark their ring slot (an older one may share it: check index).
        # Added, not scattered: empty entries (-1) and a resident token may point at the same slot.
        resident_slots = resident.clamp_min(0) % self.capacity
        marks = (self.token_index[resident_slots] == resident) & (resident >= 0)
        hits = torch.zeros(n_kv, self.capacity, dtype=torch.int32, device=device)
        in_resident = hits.scatter_add_(1, resident_slots, marks.int()) > 0
        candidate = archived.unsqueeze(0) & ~in_resident  # [n_kv, capacity]
        has_candidate = candidate.view(n_kv, self.pages, self.page_size).any(dim=2)
        # The ring fills from page 0: pages past the last one written hold nothing (no need to bound them).
        used = min(self.pages, -(-self.tokens // self.page_size))
        bound = torch.zeros(n_kv, self.pages, device=device)  # pages past `used` hold no candidate
        if used:
            bound[:, :used] = self.bounds(query, used, chunk, question=question)
        # Every page with a candidate holds at least one, so the first `slots` pages in rank order suffice.
        page_start = self.token_index.view(self.pages, self.page_size)[:, 0]
        top = min(slots, self.pages)
        key = order_key(bound, page_start, has_candidate)
        pages = torch.topk(key, top, dim=1, sorted=True).indices  # [n_kv, top]
        # Their slots in reading order (page rank, then offset = token age in the page); take the candidates.
        offset = torch.arange(self.page_size, device=device)
        in_order = (pages.unsqueeze(-1) * self.page_size + offset).flatten(1)  # [n_kv, top * page_size]
        usable = candidate.gather(1, in_order)
        place = torch.arange(in_order.shape[1], device=device).expand_as(in_order)
        place = place.masked_fill(~usable, torch.iinfo(torch.int64).max)
        count = min(slots, in_order.shape[1])
        picked = torch.topk(place, count, dim=1, largest=False, sorted=True).indices
        chosen, valid = in_order.gather(1, picked), usable.gather(1, picked)
        if count < slots:
            pad = torch.zeros(n_kv, slots - count, dtype=chosen.dtype, device=device)
            chosen, valid = torch.cat([chosen, pad], 1), torch.cat([valid, pad.bool()], 1)
        return chosen, valid

    def choose_one(
        self, query: torch.Tensor, resident: torch.Tensor, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`choose` for a one-token step (decode) in fewer and smaller ops: the same tokens in the same order.

        query: [n_kv_heads, group, head_dim], the token's unrotated queries; resident: [n_kv_heads, n] token
        indices of S, every one an entry (no -1), the newest archived token (the step's own) among them in
        every head. Returns archive slots [n_kv_heads, slots] and which hold a chosen token; the valid ones are
        `choose(query, resident, self.tokens - 1, slots)`'s, in its order (where `valid` is False the slot
        numbers may differ: they are never read). Why the result is `choose`'s: docs/design.md, recall.
        """
        n_kv, size, span = self.n_kv_heads, self.page_size, self.span
        used = span // size
        # A ring slot is blocked if empty or holding a token of S (resident tokens still archived mark their
        # slot; the others land on the spare column `span`). Scattering only True, duplicates are harmless.
        resident_slots = resident % self.capacity
        marks = self.token_index.take(resident_slots) == resident
        blocked = torch.empty(n_kv, span + size, dtype=torch.bool, device=query.device)  # + a spare page
        blocked[:, :span] = self.token_index[:span] == NOTHING
        blocked.scatter_(1, torch.where(marks, resident_slots, span), True)
        has_candidate = blocked.logical_not_().view(n_kv, used + 1, size)[:, :used].any(dim=2)
        candidate = blocked[:, :span]  # [n_kv, span], True where a candidate (negated in place above)
        bound = self.step_bounds(query)
        page_start = self.token_index.view(self.pages, size)[:used, 0]
        key = order_key(bound, page_start, has_candidate)
        return self._first_candidates(key, candidate, min(slots, used), slots)

    def _first_candidates(
        self, key: torch.Tensor, candidate: torch.Tensor, top: int, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tail of `choose_one` and `choose_fixed`: the `top` pages by `key` [n_kv_heads, pages] and the
        first `slots` of their `candidate` ring slots ([n_kv_heads, >= pages * page_size] bool) in reading
        order. Returns archive slots [n_kv_heads, slots] and which hold a chosen token."""
        n_kv, device = self.n_kv_heads, key.device
        pages = torch.topk(key, top, dim=1, sorted=True).indices
        in_order = (pages.unsqueeze(-1) * self.page_size + self._page_offsets).flatten(
            1
        )  # [n_kv, top * size]
        usable = candidate.gather(1, in_order)
        # The first `slots` usable slots in reading order: each goes to column 1 + its running count among
        # them; the others to spare columns (0, and `slots + 1` past the first `slots`); columns left without
        # one stay 0 and invalid, as `choose` pads.
        place = usable.cumsum(dim=1)  # 1-based
        target = (place * usable).clamp_max_(slots + 1)
        chosen = torch.zeros(n_kv, slots + 2, dtype=torch.int64, device=device)
        chosen = chosen.scatter_(1, target, in_order)[:, 1 : slots + 1]
        valid = torch.arange(slots, device=device) < place[:, -1:]
        return chosen, valid

    def choose_fixed(
        self, query: torch.Tensor, resident: torch.Tensor, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`choose_one` in fixed shapes, read from tensors only (the fixed step, h2o_cli.cache.fixed_step):
        every ring page is scored (those never written hold no candidate), and S's slots may be empty.

        query: [n_kv_heads, group, head_dim] unrotated; resident: [n_kv_heads, n] token indices of S (-1 =
        empty), the step's own token (the newest archived) among them. Returns what `choose` returns for
        `before` = the step's token: archive slots [n_kv_heads, slots] and which hold a chosen token."""
        n_kv, size, capacity = self.n_kv_heads, self.page_size, self.capacity
        resident_slots = resident.clamp_min(0) % capacity
        marks = (self.token_index.take(resident_slots) == resident) & (resident >= 0)
        empty = (self.token_index == NOTHING).expand(n_kv, -1)
        blocked = torch.cat([empty, empty[:, :1]], dim=1)  # + a spare column for the unmarked
        blocked.scatter_(1, torch.where(marks, resident_slots, capacity), True)
        candidate = blocked[:, :capacity].logical_not()  # [n_kv, capacity]
        has_candidate = candidate.view(n_kv, self.pages, size).any(dim=2)
        bound = self.bounds(query, self.pages, fixed=True)
        page_start = self.token_index.view(self.pages, size)[:, 0]
        key = order_key(bound, page_start, has_candidate)
        return self._first_candidates(key, candidate, min(slots, self.pages), slots)
