"""The archive of the `recall` policy: every token's unrotated K/V in pages, with key summaries to choose pages.

One `PageArchive` per layer. Tokens are written through as they arrive (before attention and eviction), into
a preallocated ring of `capacity` token slots: token `t` lives in slot `t % capacity`, and page `t // page_size`
in ring page `(t % capacity) // page_size`. When a token starts a page, the ring page it lands on is emptied
first, so the oldest page is dropped for good and nothing grows. A page is what a recall step reads back
whole; its keys are summarised in blocks of `block_size` tokens (a divisor of the page; the page itself by
default): per (ring block, KV head) the archive keeps the per-channel min and max of the block's keys (Quest's
summary), so a query bounds its best logit in a block without reading it,
`sum_i max(q_i * max_i, q_i * min_i) >= q . k` for every key `k` of the block, and a page's bound is the best
of its blocks' (as tight as pages of `block_size`, read back `page_size` tokens at a time). A long archive's
shortlist has a coarser level too: sections of `SECTION_TOKENS` tokens, each with the min/max of its blocks',
so a step bounds the sections and then the blocks of the best ones only (`shortlisted`).

Storage: K/V in RAM (`torch.empty`: the system backs them as they are written) or in a region of a memory-mapped
file (`h2o_cli.cache.recall.archive_file`), whose pages are released from the process after every write and read; in the
compute dtype, 16-bit, or int8 with one fp32 scale per (token, KV head) as `h2o_cli.cache.kvquant`. The summaries and
token indices always stay in RAM, and the summaries are taken from the exact keys as they arrive, before any
rounding to the storage dtype (after a `rewind` a partly kept page is summarised again from its stored keys).
"""

from __future__ import annotations

import torch

from h2o_cli.cache.kvquant import SCALE_DTYPE, dequantize, quantize, storage_dtype
from h2o_cli.cache.recall.limits import step_pages, summary_block

NOTHING = -1  # token index of an empty archive slot
SECTION_TOKENS = 256  # the coarse level of a shortlist: sections of this many tokens (whole pages) rank first
HALF_MAX = 65504.0  # float16's largest finite value: a held key is clamped to it, never inf


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


def as_held(keys: torch.Tensor) -> torch.Tensor:
    """Keys as a one-token step's page mass takes them (docs/spec.md): clamped to float16's finite range and
    rounded to it (nearest, ties to even), as float16. Holding the step's shortlist so halves what it reads."""
    return keys.clamp(-HALF_MAX, HALF_MAX).to(torch.float16)


def order_key(bound: torch.Tensor, page_start: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """The page order of a recall step as one int64 per (KV head, page), so one `topk` ranks the pages: larger
    bound first, then the older page; pages without a candidate (`candidate` False) last. archive.c's
    `order_key` is its C twin.

    bound: [n_kv_heads, pages] float32 (any value where `candidate` is False); page_start: [pages] token index
    of each page's first token (below 2**31). The float's bits, made monotone in its value (negative floats
    have their magnitude bits flipped; -0.0 is first made +0.0, equal to it as a float), fill the high 32
    bits, and minus the page's start the low ones."""
    bits = (bound + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # finite and ±inf: |.| < 2**31 - 2**23
    return torch.where(candidate, ordered * 2**32 - page_start, torch.iinfo(torch.int64).min)


class PageArchive:
    """One layer's archive: K/V `[n_kv_heads, capacity, head_dim]` in a ring, summaries per (page, KV head).

    `capacity` is a whole number (at least 2) of pages of `page_size` tokens. `dtype` is the compute dtype
    (what `read` returns); `bits` the storage as `--kv-bits` (None: `dtype`, 16, 8: int8 + scales); `region`
    an `ArchiveRegion` of a mapped file for the K/V (and scales), else they are allocated empty in RAM.
    """

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        bits: int | None = None,
        region=None,
        block_size: int | None = None,
        attention: bool = False,
        shortlist: int = 0,
        carry: float = 0.0,
        chunk_weight: float = 1.0,
        step_shortlist: int = 0,
    ) -> None:
        assert capacity % page_size == 0 and capacity >= 2 * page_size, "a whole number (>= 2) of pages"
        block_size = summary_block(page_size, block_size)
        assert page_size % block_size == 0, "blocks divide the page"
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.capacity, self.page_size, self.block_size = capacity, page_size, block_size
        self.attention = attention  # pages scored by attention mass (`attention_mass`), not by the summaries
        self.shortlist = shortlist  # with `attention`: only the pages the summaries bound best (0: all)
        # With `carry` and a shortlist: a one-token step scores the pages its carried scores rank best, this many
        self.step_shortlist = step_pages(shortlist, step_shortlist)
        self.carry = carry  # with `attention`: the share of a page's last score added to the next
        # With `carry`: a chunk of c > 1 tokens starts the carried scores at min(c, this) steps' weight.
        self.chunk_weight = chunk_weight
        self.pages = capacity // page_size
        self.blocks_per_page = page_size // block_size
        self.dtype, self.bits, self.region = dtype, bits, region
        stored = storage_dtype(bits, dtype)
        self.quantized = stored == torch.int8
        if region is None:

            def allocate(shape, kind):
                return torch.empty(shape, dtype=kind, device=device)

        else:
            allocate = region.take
        self.keys = allocate((n_kv_heads, capacity, head_dim), stored)
        self.values = allocate((n_kv_heads, capacity, head_dim), stored)
        self.key_scales = self.value_scales = None
        if self.quantized:
            self.key_scales = allocate((n_kv_heads, capacity), SCALE_DTYPE)
            self.value_scales = allocate((n_kv_heads, capacity), SCALE_DTYPE)
        self.token_index = torch.full((capacity,), NOTHING, dtype=torch.int64, device=device)
        # With `carry`: each ring page's last score and the first token of the page it was given to (a ring
        # page that holds another page since starts again from 0).
        self.carried = torch.zeros(n_kv_heads, self.pages, dtype=torch.float32, device=device)
        self.carried_start = torch.full((self.pages,), NOTHING, dtype=torch.int64, device=device)
        self.scored = 0  # how many times the carried scores were written (`LeadRanking.ranked` keys on it)
        # Per block: [high, low] side by side (one matmul scores both); `high` and `low` are views of it.
        blocks = capacity // block_size
        self.summary = torch.zeros(n_kv_heads, blocks, 2 * head_dim, dtype=torch.float32, device=device)
        self.high, self.low = self.summary[..., :head_dim], self.summary[..., head_dim:]
        self.tokens = 0  # tokens written so far (the next token's index)
        self._floor = 0  # no older token is held (raised by a rewind past pages the ring dropped)
        # [n_kv_heads, 1]: each KV head's first row in the K/V seen as [n_kv_heads * capacity, head_dim].
        self._head_rows = torch.arange(n_kv_heads, device=device).unsqueeze(1) * capacity
        self._page_offsets = torch.arange(page_size, device=device)
        self._head_pages = torch.arange(n_kv_heads, device=device).unsqueeze(1) * self.pages  # as _head_rows
        self._block_offsets = torch.arange(self.blocks_per_page, device=device)
        # Sections (a shortlist's first level): `section_pages` ring pages each (the last one maybe fewer); their
        # [high, low] summaries are folded from the blocks' and refreshed when read (`_section_summaries`).
        self.section_pages = max(1, SECTION_TOKENS // page_size)
        sections = -(-self.pages // self.section_pages)
        self.section_summary = torch.zeros(
            n_kv_heads, sections, 2 * head_dim, dtype=torch.float32, device=device
        )
        self._sections_at = None  # `tokens` when the section summaries were last refreshed (None: never)
        self._held_keys = None  # (pages, their keys, `tokens` then): `held_page_keys`' last result
        self.epoch = 0  # one more at every reset or rewind: what a step kept of the archive (C step) is void

    @staticmethod
    def stored_bytes(
        n_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, bits: int | None
    ) -> int:
        """Bytes of the K/V (and scales) of an archive: what its `region` must hold (each tensor 8-aligned)."""
        stored = storage_dtype(bits, dtype)
        sizes = [n_kv_heads * capacity * head_dim * stored.itemsize] * 2
        if stored == torch.int8:
            sizes += [n_kv_heads * capacity * SCALE_DTYPE.itemsize] * 2
        return sum(-(-size // 8) * 8 for size in sizes)

    def _stored(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.key_scales, self.value_scales) if t is not None]

    def nbytes(self) -> int:
        """Bytes preallocated for K/V (and scales), token index and summaries (K/V backed as written)."""
        return self.ram_bytes() + self.disk_bytes()

    def disk_bytes(self) -> int:
        """Bytes of this archive in its mapped file (the K/V and scales; 0 in RAM)."""
        return 0 if self.region is None else sum(tensor.nbytes for tensor in self._stored())

    def ram_bytes(self) -> int:
        """Bytes of this archive in RAM: token index and summaries, and the K/V without a file."""
        kept = [self.token_index, self.summary] + ([] if self.region else self._stored())
        return sum(tensor.nbytes for tensor in kept)

    def choice_bytes(self) -> int:
        """Bytes the page choice keeps beside the archive, in RAM: the carried scores, the section summaries
        and the shortlist's keys `held_page_keys` holds (the C step's are `StepScores.nbytes`)."""
        kept = [self.carried, self.carried_start, self.section_summary]
        if self._held_keys is not None:
            kept.append(self._held_keys[1])
        return sum(tensor.nbytes for tensor in kept)

    def token_bytes(self) -> int:
        """Archive bytes per token (K and V of every KV head, and their scales when int8)."""
        return sum(tensor.nbytes for tensor in self._stored()) // self.capacity

    @property
    def oldest(self) -> int:
        """Index of the oldest token still archived (how far back recall reaches); `tokens` when empty."""
        if self.tokens == 0:
            return 0
        newest_page_start = (self.tokens - 1) // self.page_size * self.page_size
        return max(0, newest_page_start + self.page_size - self.capacity, self._floor)

    @property
    def span(self) -> int:
        """Ring slots written so far (whole pages): every archived token lies below it."""
        return min(self.pages, -(-self.tokens // self.page_size)) * self.page_size

    def held(self) -> int:
        """Tokens archived now."""
        return self.tokens - self.oldest

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Archive the next tokens' K/V `[n_kv_heads, n, head_dim]` (unrotated), dropping the oldest pages."""
        if keys.shape[1] == 1:
            self._write_token(keys, values)
            return
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
        blocks = self._blocks_of(starting)
        self.low[:, blocks] = float("inf")
        self.high[:, blocks] = float("-inf")
        writes = self._writes(keys, values)
        for target, data in writes:
            if self.region is None:
                target.index_copy_(1, slots, data.to(target.dtype))
            else:
                self.region.write(target, first, data)
        self.token_index.index_copy_(0, slots, token_index)
        # Summaries from the keys as they came (exact, before any rounding): min/max folded in block by block.
        exact = keys.float()
        blocks = (slots // self.block_size).view(1, -1, 1).expand_as(exact)
        self.low.scatter_reduce_(1, blocks, exact, "amin")
        self.high.scatter_reduce_(1, blocks, exact, "amax")
        self.tokens += count

    def _blocks_of(self, pages: torch.Tensor) -> torch.Tensor:
        """The summary blocks of ring `pages` [n] (int64): [n * blocks_per_page], page by page."""
        return (pages.unsqueeze(-1) * self.blocks_per_page + self._block_offsets).flatten()

    def _writes(self, keys: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(storage tensor, data) pairs for K/V `[n_kv_heads, n, head_dim]`: as given, or int8 codes and
        their scales for an int8 archive."""
        if not self.quantized:
            return [(self.keys, keys), (self.values, values)]
        (key_codes, key_scales), (value_codes, value_scales) = quantize(keys), quantize(values)
        return [
            (self.keys, key_codes),
            (self.values, value_codes),
            (self.key_scales, key_scales),
            (self.value_scales, value_scales),
        ]

    def _write_token(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`_write_piece` of one token (a decode step's fast form, in half the ops): the same writes, its slot
        and page as Python ints (held to it by tests/test_recall.py; archive.c's `archive_token` is its C twin)."""
        token = self.tokens
        slot = token % self.capacity
        page, block = slot // self.page_size, slot // self.block_size
        if token % self.page_size == 0:  # the token starts a page: the ring page's old page is gone
            self.token_index[page * self.page_size : (page + 1) * self.page_size] = NOTHING
            blocks = slice(page * self.blocks_per_page, (page + 1) * self.blocks_per_page)
            self.summary[:, blocks, self.head_dim :] = float("inf")  # low
            self.summary[:, blocks, : self.head_dim] = float("-inf")  # high
        writes = self._writes(keys, values)
        for target, data in writes:
            if self.region is None:
                target[:, slot] = data[:, 0]
            else:
                self.region.write(target, token, data)
        self.token_index[slot : slot + 1].fill_(token)
        exact = keys[:, 0].float()  # [n_kv, head_dim]: the summaries from the keys as they came
        low, high = self.low[:, block], self.high[:, block]
        torch.minimum(low, exact, out=low)
        torch.maximum(high, exact, out=high)
        self.tokens += 1

    def write_fixed(self, keys: torch.Tensor, values: torch.Tensor, token: torch.Tensor) -> None:
        """`_write_token` with the token's index a tensor `token` [1] (int64), for the fixed step
        (h2o_cli.cache.fixed_step): the same writes, its slot, page and page start computed on the device, no
        Python counter read. RAM archives only; `tokens` is advanced after the step (`stepped_fixed`)."""
        slot = token % self.capacity
        page = slot // self.page_size
        starts = (token % self.page_size == 0).view(1, 1)  # the ring page's old page is gone
        page_slots = self.token_index.view(self.pages, self.page_size)
        page_slots.index_copy_(0, page, torch.where(starts, NOTHING, page_slots.index_select(0, page)))
        for target, data in self._writes(keys, values):
            target.index_copy_(1, slot, data.to(target.dtype))
        self.token_index.index_copy_(0, slot, token)
        # The page's blocks (all emptied where the token starts the page), the token's own taking its key.
        blocks = self._blocks_of(page)  # [blocks_per_page]
        own = (self._block_offsets == slot % self.page_size // self.block_size).view(1, -1, 1)
        exact = keys.float()  # [n_kv, 1, head_dim]: the summaries from the keys as they came
        low = torch.where(starts, float("inf"), self.low.index_select(1, blocks))
        high = torch.where(starts, float("-inf"), self.high.index_select(1, blocks))
        self.low.index_copy_(1, blocks, torch.where(own, torch.minimum(low, exact), low))
        self.high.index_copy_(1, blocks, torch.where(own, torch.maximum(high, exact), high))

    def stepped_fixed(self) -> None:
        """The Python count after a fixed step's `write_fixed`."""
        self.tokens += 1

    def _summarise(self, pages: torch.Tensor) -> None:
        """Recompute the min/max keys of ring `pages` [n]' blocks from the tokens they hold (stored keys)."""
        blocks, size = self._blocks_of(pages), self.block_size
        held = (self.token_index.view(-1, size)[blocks] != NOTHING).view(1, -1, size, 1)
        shape = (self.n_kv_heads, self.capacity // size, size)
        block_keys = self.keys.view(*shape, self.head_dim)[:, blocks].float()
        if self.quantized:
            block_keys = dequantize(block_keys, self.key_scales.view(shape)[:, blocks], torch.float32)
        self.low[:, blocks] = block_keys.masked_fill(~held, float("inf")).amin(dim=2)
        self.high[:, blocks] = block_keys.masked_fill(~held, float("-inf")).amax(dim=2)
        self.release()

    def read(self, heads: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of archive `slots` [n] of KV `heads` [n], in the compute dtype: ([n, head_dim], [n, head_dim])."""
        keys, values = self.keys[heads, slots], self.values[heads, slots]
        if self.quantized:
            keys = dequantize(keys, self.key_scales[heads, slots], self.dtype)
            values = dequantize(values, self.value_scales[heads, slots], self.dtype)
        else:
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        self.release()
        return keys, values

    def release(self) -> None:
        """With a mapped file, drop its pages from the process's resident memory (nothing in RAM)."""
        if self.region is not None:
            self.region.release()

    def reset(self) -> None:
        """Forget every token (the buffers stay)."""
        self.token_index.fill_(NOTHING)
        self.carried_start.fill_(NOTHING)
        self.tokens = self._floor = 0
        self._sections_at = self._held_keys = None
        self.epoch += 1

    def rewind(self, tokens: int) -> None:
        """Forget the tokens from index `tokens` on (a scorer going back to a snapshot). Pages the ring dropped
        for them do not come back."""
        self.carried_start.fill_(NOTHING)  # the scores carried so far are forgotten
        self._sections_at = self._held_keys = None
        self.epoch += 1
        newer = self.token_index >= tokens
        touched = torch.unique(newer.nonzero().flatten() // self.page_size)
        self.token_index[newer] = NOTHING
        self.tokens = tokens
        # What is left is a run of the newest tokens before `tokens`, maybe shorter than the ring's reach
        # (the pages dropped for the forgotten ones): `oldest` and `held` stay exact.
        held = self.token_index[self.token_index != NOTHING]
        self._floor = int(held.min()) if held.numel() else tokens
        if touched.numel():
            self._summarise(touched)

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
        not in S. Pages with a candidate are ranked by the max over the m queries of `page_bound` (ties: the
        older page first); their candidates are taken in that order, oldest first inside a page. `chunk`: the
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

    def steps_score_carried_shortlist(self) -> bool:
        """Whether a one-token step's `step_bounds` scores the `step_shortlist` pages its carried scores rank
        best, or every written page when there are no more (the case archive.c's `archive_step_scores` computes):
        attention mass, carried scores, a shortlist, and a page written."""
        return self.attention and bool(self.carry) and self.shortlist > 0 and self.span > 0

    def step_bounds(self, query: torch.Tensor) -> torch.Tensor:
        """The page bounds `choose_one` ranks by, for the ring pages written so far: query [n_kv_heads, group,
        head_dim] (unrotated). Returns [n_kv_heads, span // page_size] float32 (the C step's input)."""
        return self.bounds(query, self.span // self.page_size)

    def bounds(
        self, query: torch.Tensor, pages: int, chunk: int = 1, fixed: bool = False, question: bool = False
    ) -> torch.Tensor:
        """The score every choice ranks the first `pages` ring pages by: the bound under the best of the `m`
        queries, the best of its blocks' `best_page_bound`; with `attention`, `attention_mass` instead, over
        every page for a `question` or up to `shortlist` pages, else over the `shortlist` pages the summaries
        bound best (`shortlisted`) — or, on a one-token step with `carry`, the `step_shortlist` pages the
        carried scores rank best (what the question and the steps since found; every page up to that many).
        With `carry` the score adds `carry` times the page's last score on a one-token step; a chunk of `chunk`
        > 1 tokens starts afresh, its mass times min(chunk, `chunk_weight`). query: [n_kv_heads, m, head_dim].
        Returns [n_kv_heads, pages] float32."""
        if not self.attention:
            return self.summary_bounds(query, pages)
        page_start = self.token_index.view(self.pages, self.page_size)[:pages, 0]
        step = self.carry and chunk == 1
        if step:  # the scores carried from the last choice, for the pages that still hold the same page
            same = (self.carried_start[:pages] == page_start) & (page_start != NOTHING)
            last = torch.where(same, self.carried[:, :pages], 0.0)
        if question or not self.shortlist or pages <= (self.step_shortlist if step else self.shortlist):
            scores = self.attention_mass(query, pages, held=bool(step))
        else:
            keys = None
            if step:
                # The carried scores' best (ties: the older page), in one order: their keys are kept between
                # steps (not in fixed shapes).
                key = order_key(last, page_start, page_start != NOTHING)
                picked = torch.topk(key, self.step_shortlist, dim=1, sorted=False).indices.sort(dim=1).values
                keys = None if fixed else self.held_page_keys(picked)
            else:  # the summaries pick the `shortlist` pages (sections first)
                picked = self.shortlisted(query, pages, page_start, fixed)  # [n_kv, shortlist]
            scores = torch.zeros(self.n_kv_heads, pages, device=query.device)
            scores.scatter_(1, picked, self.attention_mass(query, pages, picked, keys=keys, held=bool(step)))
        if self.carry:
            if step:
                scores += self.carry * last
            else:  # a new text or turn starts afresh, weighing min(chunk, chunk_weight) one-token steps
                scores *= min(chunk, self.chunk_weight)
            self.carried[:, :pages] = scores
            self.carried_start[:pages] = page_start
            if not fixed:  # the fixed step changes no Python value (a captured graph); it takes no lead
                self.scored += 1
        return scores

    def shortlisted(
        self, query: torch.Tensor, pages: int, page_start: torch.Tensor, fixed: bool = False
    ) -> torch.Tensor:
        """The `shortlist` pages (of the first `pages`) whose summary bound under the best of the `m` queries is
        highest, per KV head (ties: the older page). With sections (`section_pages` ring pages each, when the
        shortlist is at least one, and `keep = ceil(2 * shortlist / section_pages)`
        sections hold at most a quarter of the pages), two levels: the sections ranked by the bound of their
        own summary (the min/max over their pages' keys; ties: the older section), then the pages of the best
        `keep` sections only, so a step bounds every section and a fixed number of blocks however long the
        archive. `fixed`: every section's summary is folded afresh
        (fixed shapes, the fixed step). query: [n_kv_heads, m, head_dim]; page_start: [pages] first token
        index of each ring page (NOTHING: empty). Returns ring pages [n_kv_heads, shortlist]."""
        size = self.section_pages
        sections, keep = -(-pages // size), -(-2 * self.shortlist // size)
        if sections < 4 * keep or self.shortlist < size:  # the flat bound is as cheap
            key = order_key(self.summary_bounds(query, pages), page_start, page_start != NOTHING)
            return torch.topk(key, self.shortlist, dim=1, sorted=False).indices
        starts = page_start.new_full((sections * size,), NOTHING)
        starts[:pages] = page_start
        summary = self._section_summaries(starts, fixed)[:, :sections]
        section_start = starts.view(sections, size)[:, 0]
        key = order_key(best_page_bound(query.float(), summary), section_start, section_start != NOTHING)
        best = torch.topk(key, keep, dim=1, sorted=False).indices  # [n_kv, keep]
        chosen = (best.unsqueeze(-1) * size + torch.arange(size, device=best.device)).flatten(1)  # ring pages
        blocks = (chosen.unsqueeze(-1) * self.blocks_per_page + self._block_offsets).flatten(1)
        # A short last section's pages past the ring read some block (clamped); they rank last below.
        blocks.clamp_max_(self.summary.shape[1] - 1)
        rows = (
            blocks + torch.arange(self.n_kv_heads, device=blocks.device).unsqueeze(1) * self.summary.shape[1]
        )
        summaries = self.summary.view(-1, 2 * self.head_dim).index_select(0, rows.view(-1))
        per_block = best_page_bound(query.float(), summaries.view(self.n_kv_heads, -1, 2 * self.head_dim))
        per_block.masked_fill_(summaries.view(self.n_kv_heads, -1, 2 * self.head_dim)[..., 0] == float("-inf"),
                               float("-inf"))  # fmt: skip
        bound = per_block.view(self.n_kv_heads, -1, self.blocks_per_page).amax(dim=2)
        start = starts.take(chosen)  # NOTHING past `pages`: ranked last (the shortlist is at least a section)
        key = order_key(bound, start, start != NOTHING)
        return chosen.gather(1, torch.topk(key, self.shortlist, dim=1, sorted=False).indices)

    def _section_summaries(self, starts: torch.Tensor, fixed: bool) -> torch.Tensor:
        """The sections' [high, low] summaries [n_kv_heads, sections, 2 * head_dim], folded from the blocks of
        the ring pages that hold a page (`starts` [>= pages]: each ring page's first token index, NOTHING when
        empty or not scored; such a page adds nothing): every section when `fixed` or after a reset or rewind,
        else only those written since the last fold."""
        size, sections = self.section_pages, self.section_summary.shape[1]
        if fixed or self._sections_at is None or self.tokens - self._sections_at >= self.capacity:
            touched = torch.arange(sections, device=self.summary.device)
        else:
            slots = torch.arange(self._sections_at, self.tokens, device=self.summary.device) % self.capacity
            touched = torch.unique(slots // (size * self.page_size))
        if touched.numel():
            per = size * self.blocks_per_page
            blocks = (touched.unsqueeze(-1) * per + torch.arange(per, device=touched.device)).flatten()
            total = self.summary.shape[1]  # a short last section's blocks past the ring add nothing
            folded = self.summary.index_select(1, blocks.clamp_max(total - 1))
            folded = folded.view(self.n_kv_heads, -1, per, 2 * self.head_dim)
            held = starts.take((blocks // self.blocks_per_page).clamp_max(starts.numel() - 1)) != NOTHING
            written = (held & (blocks < min(total, starts.numel() * self.blocks_per_page))).view(
                1, -1, per, 1
            )
            high, low = folded[..., : self.head_dim], folded[..., self.head_dim :]
            high = high.masked_fill(~written, float("-inf")).amax(dim=2)
            low = low.masked_fill(~written, float("inf")).amin(dim=2)
            self.section_summary.index_copy_(1, touched, torch.cat([high, low], dim=2))
        if not fixed:
            self._sections_at = self.tokens
        return self.section_summary

    def summary_bounds(self, query: torch.Tensor, pages: int) -> torch.Tensor:
        """The bound of each of the first `pages` ring pages under the best of the `m` queries: the best of its
        blocks' `best_page_bound`. query: [n_kv_heads, m, head_dim]. Returns [n_kv_heads, pages] float32."""
        blocks = pages * self.blocks_per_page
        per_block = best_page_bound(query.float(), self.summary[:, :blocks])
        if self.blocks_per_page == 1:
            return per_block
        # A block not yet written (the newest page's later ones) bounds nothing: -inf, not the NaN of 0 * inf.
        per_block.masked_fill_(self.high[:, :blocks, 0] == float("-inf"), float("-inf"))
        return per_block.view(self.n_kv_heads, pages, self.blocks_per_page).amax(dim=2)

    def attention_mass(
        self,
        query: torch.Tensor,
        pages: int,
        picked: torch.Tensor | None = None,
        block: int = 32,
        keys: torch.Tensor | None = None,
        held: bool = False,
    ) -> torch.Tensor:
        """The attention the `m` queries put on each of the first `pages` ring pages (or on the pages `picked`
        [n_kv_heads, k] of each KV head), each query's softmax taken over every token those pages hold
        (`head_dim ** -0.5` scaling, as the model's attention): the sum over the queries and the page's tokens
        (docs/spec.md, recall: `--page-score attention`). Reads those pages' keys (dequantised when int8), or
        takes them as `keys` (`page_keys(picked)`), in blocks of `block` queries so no [m, tokens] tensor is
        made; `held`: over the keys rounded to half precision (`as_held`), as a one-token step scores.
        query: [n_kv_heads, m, head_dim].
        Returns [n_kv_heads, pages] (or [n_kv_heads, k], in `picked`'s order) float32."""
        n_kv, size = self.n_kv_heads, self.page_size
        if picked is None:
            slots = torch.arange(pages * size, device=query.device).expand(n_kv, -1)
            keys, scales = self.keys[:, : pages * size], None if not self.quantized else self.key_scales
            if self.quantized:
                keys = dequantize(keys, scales[:, : pages * size], torch.float32)
        else:
            slots = (picked.unsqueeze(-1) * size + self._page_offsets).flatten(1)  # [n_kv, k * size]
            if keys is None:
                keys = self.page_keys(picked)
        if held and keys.dtype != torch.float16:
            keys = as_held(keys)
        keys = keys.float().transpose(1, 2)  # [n_kv, head_dim, tokens]
        empty = (self.token_index.take(slots) == NOTHING).unsqueeze(1)  # [n_kv, 1, tokens]
        query = query.float() * self.head_dim**-0.5
        mass = torch.zeros(n_kv, slots.shape[1], device=query.device)
        for start in range(0, query.shape[1], block):
            logits = torch.bmm(query[:, start : start + block], keys).masked_fill_(empty, float("-inf"))
            mass += torch.softmax(logits, dim=-1).sum(dim=1)
        self.release()
        return mass.view(n_kv, -1, size).sum(dim=2) / query.shape[1]  # the mean over the queries

    def page_keys(self, picked: torch.Tensor) -> torch.Tensor:
        """The keys of ring pages `picked` [n_kv_heads, k] of each KV head, page after page, as float32:
        [n_kv_heads, k * page_size, head_dim]."""
        keys = self._page_rows((picked + self._head_pages).view(-1))
        return keys.view(self.n_kv_heads, -1, self.head_dim)

    def _page_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The keys of (KV head, ring page) rows `rows` [n] (head * pages + page) as float32 [n, page_size,
        head_dim], dequantised when int8. The K seen as [n_kv * pages, size * d]: one index_select of whole
        pages reads them faster than one of token rows, and far faster than a gather over [n_kv, capacity, d]."""
        size, d = self.page_size, self.head_dim
        keys = self.keys.view(-1, size * d).index_select(0, rows).view(-1, size, d)
        if self.quantized:
            keys = dequantize(keys, self.key_scales.view(-1, size).index_select(0, rows), torch.float32)
        self.release()
        return keys.float()

    def held_page_keys(self, picked: torch.Tensor) -> torch.Tensor:
        """`page_keys(picked)`, kept from one call to the next: an answer's steps score the same pages step
        after step (a page outside the carried ranking's best never gains on one inside it), so the keys are
        read again when the pages change, and otherwise only those of the pages written since; held in half
        precision (`as_held`), as the step scores them. picked: [n_kv_heads, k] ring pages.
        Returns [n_kv_heads, k * page_size, head_dim] float16."""
        held = self._held_keys
        if held is None or held[2] > self.tokens or not torch.equal(held[0], picked):
            keys = as_held(self.page_keys(picked))
        else:
            keys, since = held[1], held[2]
            if since < self.tokens:  # pages written since hold new keys (or another page, the ring wrapped)
                written = torch.arange(since // self.page_size, (self.tokens - 1) // self.page_size + 1)
                stale = torch.isin(picked, written.to(picked.device) % self.pages)
                heads, columns = stale.nonzero(as_tuple=True)
                if heads.numel():
                    pages = keys.view(self.n_kv_heads, picked.shape[1], self.page_size, self.head_dim)
                    pages[heads, columns] = as_held(
                        self._page_rows(picked[heads, columns] + heads * self.pages)
                    )
        self._held_keys = (picked, keys, self.tokens)
        return keys

    def read_into(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the K and V of archive `slots` [n_kv_heads, r] (one row per KV head) into `keys`, `values`
        [n_kv_heads, r, head_dim] (contiguous, the compute dtype): `read` with every head's slots at once."""
        rows = (slots + self._head_rows).view(-1)  # [n_kv * r] rows of the K/V seen as [n_kv * capacity, d]
        for stored, scales, target in (
            (self.keys, self.key_scales, keys),
            (self.values, self.value_scales, values),
        ):
            out = target.view(-1, self.head_dim)
            if self.quantized:
                codes = stored.view(-1, self.head_dim).index_select(0, rows)
                out.copy_(dequantize(codes, scales.view(-1).index_select(0, rows), self.dtype))
            elif stored.dtype == target.dtype:
                torch.index_select(stored.view(-1, self.head_dim), 0, rows, out=out)
            else:
                out.copy_(stored.view(-1, self.head_dim).index_select(0, rows))
        self.release()
