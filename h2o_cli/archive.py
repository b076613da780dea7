"""The archive of the `recall` policy: every token's unrotated K/V in pages, with key summaries to choose pages.

One `PageArchive` per layer. Tokens are written through as they arrive (before attention and eviction), into
a preallocated ring of `capacity` token slots: token `t` lives in slot `t % capacity`, and page `t // page_size`
in ring page `(t % capacity) // page_size`. When a token starts a page, the ring page it lands on is emptied
first, so the oldest page is dropped for good and nothing grows. Per (ring page, KV head) the archive keeps
the per-channel min and max of the page's keys (Quest's summary), so a query bounds its best logit in a page
without reading the page: `sum_i max(q_i * max_i, q_i * min_i) >= q . k` for every key `k` of the page.
"""

from __future__ import annotations

import torch

NOTHING = -1  # token index of an empty archive slot


def page_bound(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of `q . k` over a page's keys, for each (query, page).

    query: [n_kv_heads, m, head_dim] (float32); low, high: [n_kv_heads, pages, head_dim] per-channel min and
    max of each page's keys. Returns [n_kv_heads, m, pages]: `sum_i max(q_i * high_i, q_i * low_i)`.
    """
    # max(q*hi, q*lo) = q+ * hi + q- * lo (q+ = max(q, 0), q- = min(q, 0)): two matmuls, no [m, pages, d].
    positive, negative = query.clamp_min(0), query.clamp_max(0)
    return torch.bmm(positive, high.transpose(1, 2)) + torch.bmm(negative, low.transpose(1, 2))


def best_page_bound(query: torch.Tensor, summary: torch.Tensor, block: int = 128) -> torch.Tensor:
    """`page_bound(...).amax(dim=1)` — each page's bound under the best of the `m` queries — computed as one
    matmul per block of queries: `summary` [n_kv_heads, pages, 2 * head_dim] holds `[high, low]` side by side,
    so `[high, low] . [q+, q-]` is the bound, and a block's [pages, block] result is folded into a running max
    (no [m, pages] tensor for a chunk of hundreds of queries). Returns [n_kv_heads, pages]."""
    signed = torch.cat([query.clamp_min(0), query.clamp_max(0)], dim=2)  # [n_kv, m, 2d]
    best = None
    for start in range(0, signed.shape[1], block):
        bounds = torch.bmm(summary, signed[:, start : start + block].transpose(1, 2)).amax(dim=2)
        best = bounds if best is None else torch.maximum(best, bounds)
    return best


def rank_key(bound: torch.Tensor, page_start: torch.Tensor) -> torch.Tensor:
    """One float64 key per (KV head, page) whose descending order is "larger bound first, then the older
    page": the float32 bound plus a tie-break under a quarter of its float32 spacing (ulp), larger for older
    pages. Distinct float32 bounds stay in their order (the tie-break never reaches half an ulp) and equal ones
    are ordered by age, so one `topk` replaces a sort by age and a stable sort by bound.

    bound: [n_kv_heads, pages] float32 (-inf for pages that cannot be chosen); page_start: [pages] token index
    of each page's first token (smaller = older)."""
    ulp = (torch.nextafter(bound, torch.full_like(bound, float("inf"))) - bound).double()
    span = float(page_start.max() - page_start.min()) + 1.0
    youth = (page_start - page_start.min()).double() / span  # [0, 1): 0 for the oldest page
    return bound.double() + torch.nan_to_num(ulp * 0.25 * (1.0 - youth), nan=0.0, posinf=0.0)


class PageArchive:
    """One layer's archive: K/V `[n_kv_heads, capacity, head_dim]` in a ring, summaries per (page, KV head).

    `capacity` is a whole number (at least 2) of pages of `page_size` tokens. The K/V buffers are allocated
    empty (`torch.empty`): the operating system backs them as they are written, up to the cap.
    """

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        assert capacity % page_size == 0 and capacity >= 2 * page_size, "a whole number (>= 2) of pages"
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.capacity, self.page_size = capacity, page_size
        self.pages = capacity // page_size
        self.keys = torch.empty(n_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty(n_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.token_index = torch.full((capacity,), NOTHING, dtype=torch.int64, device=device)
        # Per page: [high, low] side by side (one matmul scores both); `high` and `low` are views of it.
        self.summary = torch.zeros(n_kv_heads, self.pages, 2 * head_dim, dtype=torch.float32, device=device)
        self.high, self.low = self.summary[..., :head_dim], self.summary[..., head_dim:]
        self.tokens = 0  # tokens written so far (the next token's index)

    def nbytes(self) -> int:
        """Bytes preallocated for K/V, token index and summaries (the K/V part is backed as it is written)."""
        return sum(tensor.nbytes for tensor in (self.keys, self.values, self.token_index, self.summary))

    def token_bytes(self) -> int:
        """Archive bytes per token (K and V of every KV head)."""
        return 2 * self.n_kv_heads * self.head_dim * self.keys.element_size()

    @property
    def oldest(self) -> int:
        """Index of the oldest token still archived (how far back recall reaches); `tokens` when empty."""
        if self.tokens == 0:
            return 0
        newest_page_start = (self.tokens - 1) // self.page_size * self.page_size
        return max(0, newest_page_start + self.page_size - self.capacity)

    def held(self) -> int:
        """Tokens archived now."""
        return self.tokens - self.oldest

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Archive the next tokens' K/V `[n_kv_heads, n, head_dim]` (unrotated), dropping the oldest pages."""
        # A piece of at most capacity - page_size tokens never wraps onto the ring page it started on, so the
        # pages it empties hold no token of the same piece.
        step = self.capacity - self.page_size
        for start in range(0, keys.shape[1], step):
            self._write_piece(keys[:, start : start + step], values[:, start : start + step])

    def _write_piece(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        count, first = keys.shape[1], self.tokens
        token_index = torch.arange(first, first + count, device=self.token_index.device)
        slots = token_index % self.capacity
        page_slots = self.token_index.view(self.pages, self.page_size)
        starting = slots[token_index % self.page_size == 0] // self.page_size
        page_slots[starting] = NOTHING  # these ring pages now begin a new page: the old one is gone
        self.keys.index_copy_(1, slots, keys.to(self.keys.dtype))
        self.values.index_copy_(1, slots, values.to(self.values.dtype))
        self.token_index.index_copy_(0, slots, token_index)
        self._summarise(torch.unique(slots // self.page_size))
        self.tokens += count

    def _summarise(self, pages: torch.Tensor) -> None:
        """Recompute the min/max keys of ring `pages` [n] from the tokens they hold."""
        held = (self.token_index.view(self.pages, self.page_size)[pages] != NOTHING).view(
            1, -1, self.page_size, 1
        )
        page_keys = self.keys.view(self.n_kv_heads, self.pages, self.page_size, self.head_dim)[
            :, pages
        ].float()
        self.low[:, pages] = page_keys.masked_fill(~held, float("inf")).amin(dim=2)
        self.high[:, pages] = page_keys.masked_fill(~held, float("-inf")).amax(dim=2)

    def reset(self) -> None:
        """Forget every token (the buffers stay)."""
        self.token_index.fill_(NOTHING)
        self.tokens = 0

    def rewind(self, tokens: int) -> None:
        """Forget the tokens from index `tokens` on (a scorer going back to a snapshot). Pages the ring dropped
        for them do not come back."""
        newer = self.token_index >= tokens
        touched = torch.unique(newer.nonzero().flatten() // self.page_size)
        self.token_index[newer] = NOTHING
        self.tokens = tokens
        if touched.numel():
            self._summarise(touched)

    def choose(
        self, query: torch.Tensor, resident: torch.Tensor, before: int, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick up to `slots` archived tokens per KV head for a chunk's queries (pass 1 of a recall step).

        query: [n_kv_heads, m, head_dim], the chunk's unrotated queries of each KV head's query heads
        (m = group * chunk); resident: [n_kv_heads, n] token indices of S (-1 = empty); `before`: the chunk's
        first token (only older tokens are candidates). A candidate is an archived token older than `before`
        not in S. Pages with a candidate are ranked by the max over the m queries of `page_bound` (ties: the
        older page first); their candidates are taken in that order, oldest first inside a page.
        Returns archive slots [n_kv_heads, slots] and which of them hold a chosen token [n_kv_heads, slots].
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
        bound = best_page_bound(query.float(), self.summary)  # [n_kv, pages]
        bound = bound.masked_fill(~has_candidate, float("-inf"))
        # Every page with a candidate holds at least one, so the first `slots` pages in rank order suffice.
        page_start = self.token_index.view(self.pages, self.page_size)[:, 0]
        top = min(slots, self.pages)
        pages = torch.topk(rank_key(bound, page_start), top, dim=1, sorted=True).indices  # [n_kv, top]
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
