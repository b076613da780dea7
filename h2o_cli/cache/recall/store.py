"""The storage of the `recall` archive: every token's unrotated K/V in a ring of pages, its token index, and the
key summaries of its pages; the write of a piece, and the reads.

Tokens are written through as they arrive (before attention and eviction), into a preallocated ring of
`capacity` token slots: token `t` lives in slot `t % capacity`, and page `t // page_size` in ring page
`(t % capacity) // page_size`. When a token starts a page, the ring page it lands on is emptied first, so the
oldest page is dropped for good and nothing grows. A page is what a recall step reads back whole; its keys are
summarised in blocks of `block_size` tokens (a divisor of the page): per (ring block, KV head) the store keeps
the per-channel min and max of the block's keys (Quest's summary), which page scoring
(`h2o_cli.cache.recall.scores`) bounds a query's logits by.

K/V and summaries live in RAM (`torch.empty`: the system backs K/V as they are written) or in a region of a
memory-mapped file (`h2o_cli.cache.recall.archive_file`), whose pages are released from the process after
every write and read, so the resident memory stays flat however far the archive reaches (its disk space is
reserved `GROW_TOKENS` ring slots ahead of the writes, `prepare_write`); K/V in the compute dtype, 16-bit, or
int8 with one fp32 scale per (token, KV head) as `h2o_cli.cache.kvquant`. The token indices always stay in
RAM, and the summaries are taken from the exact keys as they arrive, before any rounding to the storage dtype
(after a `rewind` a partly kept page is summarised again from its stored keys). The first page a text's
tokens drop (the ring wraps) is said in one line (`limits.tell_outgrown`).

One rule, one body: `_write_piece` is the write; `_write_token` (a decode step's write) and `write_fixed` (the
fixed step's) are its one-token forms, pinned to it bit for bit by
tests/test_recall.py::test_one_token_writes_are_the_piece_write (archive.c's `archive_tokens` is the C twin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from h2o_cli.cache.kvquant import SCALE_DTYPE, dequantize, quantize, storage_dtype
from h2o_cli.cache.recall.limits import GROW_TOKENS, forget_told, summary_block, tell_outgrown
from h2o_cli.cache.recall.saved_store import SavedStore

if TYPE_CHECKING:
    from h2o_cli.cache.recall.archive import PageSettings

NOTHING = -1  # token index of an empty archive slot
# What a saved read keeps of the page scoring (`PageScoring`, h2o_cli.cache.recall.scores) beside the store's.


class ArchiveStore(SavedStore):
    """One layer's archive storage: K/V `[n_kv_heads, capacity, head_dim]` in a ring, the token index
    `[capacity]` of each slot (NOTHING: empty), and the key summary `[n_kv_heads, blocks, 2 * head_dim]`.

    `capacity` is a whole number (at least 2) of pages of `settings.page_size` tokens, summarised in blocks of
    `settings.block_size` (None: 4 where 4 divides the page, else the page). `dtype` is the compute dtype (what
    `read` returns); `bits` the storage as `--kv-bits` (None: `dtype`, 16, 8: int8 + scales); `region` an
    `ArchiveRegion` of a mapped file for the K/V (and scales), and the summaries when it was sized for them
    too (`stored_bytes` with the block), else they are allocated in RAM.
    """

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        settings: PageSettings,
        dtype: torch.dtype,
        device: torch.device,
        bits: int | None = None,
        region=None,
    ) -> None:
        page_size = settings.page_size
        assert capacity % page_size == 0 and capacity >= 2 * page_size, "a whole number (>= 2) of pages"
        block_size = summary_block(page_size, settings.block_size)
        assert page_size % block_size == 0, "blocks divide the page"
        self.settings = settings  # what it was built from (`PageScoring` reads its scoring settings)
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.capacity, self.page_size, self.block_size = capacity, page_size, block_size
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
        # Per block: [high, low] side by side (one matmul scores both); `high` and `low` are views of it. In a
        # file (a region sized for them) they start as its zeros, as in RAM; a block is emptied (inf, -inf)
        # before its first key.
        summary = (n_kv_heads, capacity // block_size, 2 * head_dim)
        self.summaries_in_file = region is not None and region.fits(summary, torch.float32)
        if self.summaries_in_file:
            self.summary = region.take(summary, torch.float32)
        else:
            self.summary = torch.zeros(summary, dtype=torch.float32, device=device)
        self.high, self.low = self.summary[..., :head_dim], self.summary[..., head_dim:]
        self.tokens = 0  # tokens written so far (the next token's index)
        self._floor = 0  # no older token is held (raised by a rewind past pages the ring dropped)
        # [n_kv_heads, 1]: each KV head's first row in the K/V seen as [n_kv_heads * capacity, head_dim].
        self._head_rows = torch.arange(n_kv_heads, device=device).unsqueeze(1) * capacity
        self._page_offsets = torch.arange(page_size, device=device)
        self._head_pages = torch.arange(n_kv_heads, device=device).unsqueeze(1) * self.pages  # as _head_rows
        self._block_offsets = torch.arange(self.blocks_per_page, device=device)
        self.epoch = 0  # one more at every reset or rewind: what a step kept of the archive (C step) is void
        forget_told()  # a new archive: the first page its text drops is told

    @staticmethod
    def stored_bytes(
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        bits: int | None,
        block_size: int | None = None,
    ) -> int:
        """Bytes of the K/V (and scales) of an archive, and with `block_size` (tokens per summary) its
        summaries: what its `region` must hold (each tensor 8-aligned)."""
        stored = storage_dtype(bits, dtype)
        sizes = [n_kv_heads * capacity * head_dim * stored.itemsize] * 2
        if stored == torch.int8:
            sizes += [n_kv_heads * capacity * SCALE_DTYPE.itemsize] * 2
        if block_size:
            sizes.append(n_kv_heads * (capacity // block_size) * 2 * head_dim * 4)
        return sum(-(-size // 8) * 8 for size in sizes)

    def _stored(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.key_scales, self.value_scales) if t is not None]

    def _in_file(self) -> list[torch.Tensor]:
        """The tensors in the mapped file (none in RAM): K/V, scales and summaries."""
        if self.region is None:
            return []
        return [*self._stored(), self.summary] if self.summaries_in_file else self._stored()

    def prepare_write(self, count: int) -> None:
        """Before the next `count` tokens are written (by `write`, or the C step through the mapping): a file
        archive reserves their slots on disk, `GROW_TOKENS` ahead (ArchiveError, one line, when the disk is
        full), and the first token that drops a page of the text is told (`tell_outgrown`)."""
        end = self.tokens + count
        if self.region is not None and end > self.region.reserved:
            self.region.reserve(end, self.capacity, GROW_TOKENS)
        if self.tokens <= self.capacity < end and self.capacity > self._floor:
            tell_outgrown(self.capacity, self.capacity)

    def nbytes(self) -> int:
        """Bytes preallocated for K/V (and scales), token index and summaries (K/V backed as written)."""
        return self.ram_bytes() + self.disk_bytes()

    def disk_bytes(self) -> int:
        """Bytes of this archive in its mapped file (the K/V, scales and summaries; 0 in RAM)."""
        return sum(tensor.nbytes for tensor in self._in_file())

    def ram_bytes(self) -> int:
        """Bytes of this archive in RAM: the token index, and the K/V and summaries without a file."""
        kept = [self.token_index] + ([] if self.summaries_in_file else [self.summary])
        kept += [] if self.region else self._stored()
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
        self.prepare_write(count)
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
        self._summarise_piece(keys.float(), slots)
        self.tokens += count
        self.release()  # the summaries written through the mapping leave the process

    def _summarise_piece(self, exact: torch.Tensor, slots: torch.Tensor) -> None:
        """Fold the keys just written (float32 `[n_kv_heads, n, head_dim]`, as they came: exact, before any
        rounding) into their blocks' min/max; whole blocks in a row (a chunk's piece) by one reduction over a
        view, any other piece block by block. The same values either way (min and max are exact)."""
        n_kv, count, head_dim = exact.shape
        first, size = int(slots[0]), self.block_size
        if first % size == 0 and count % size == 0 and first + count <= self.capacity:
            blocks = slice(first // size, (first + count) // size)
            shaped = exact.view(n_kv, count // size, size, head_dim)
            self.low[:, blocks] = torch.minimum(self.low[:, blocks], shaped.amin(dim=2))
            self.high[:, blocks] = torch.maximum(self.high[:, blocks], shaped.amax(dim=2))
            return
        blocks = (slots // size).view(1, -1, 1).expand_as(exact)
        self.low.scatter_reduce_(1, blocks, exact, "amin")
        self.high.scatter_reduce_(1, blocks, exact, "amax")

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
        and page as Python ints (held to it by tests/test_recall.py; archive.c's `archive_tokens` is its C twin)."""
        token = self.tokens
        self.prepare_write(1)
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
        self.release()

    def write_fixed(self, keys: torch.Tensor, values: torch.Tensor, token: torch.Tensor) -> None:
        """`_write_piece` of one token with the token's index a tensor `token` [1] (int64), for the fixed step
        (h2o_cli.cache.fixed_step): the same writes, its slot, page and page start computed on the device, no
        Python counter read (held to it by tests/test_recall.py). RAM archives only; `tokens` is advanced
        after the step (`stepped_fixed`)."""
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
        self.prepare_write(1)  # RAM only: tells a first dropped page
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
        rows = heads * self.capacity + slots  # of the K/V seen as [n_kv * capacity, head_dim]: one row select
        keys = self.keys.view(-1, self.head_dim).index_select(0, rows)
        values = self.values.view(-1, self.head_dim).index_select(0, rows)
        if self.quantized:
            keys = dequantize(keys, self.key_scales.view(-1).index_select(0, rows), self.dtype)
            values = dequantize(values, self.value_scales.view(-1).index_select(0, rows), self.dtype)
        else:
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        self.release()
        return keys, values

    def read_ahead(self) -> None:
        """The next read takes every page in order (a question's score): a mapped file reads ahead until
        `release` (`ArchiveRegion.read_ahead`; nothing in RAM)."""
        if self.region is not None:
            self.region.read_ahead()

    def release(self) -> None:
        """With a mapped file, drop its pages from the process's resident memory (nothing in RAM)."""
        if self.region is not None:
            self.region.release()

    def reset(self) -> None:
        """Forget every token (the buffers stay)."""
        self.token_index.fill_(NOTHING)
        self.tokens = self._floor = 0
        self.epoch += 1

    def rewind(self, tokens: int) -> None:
        """Forget the tokens from index `tokens` on (a scorer going back to a snapshot). Pages the ring dropped
        for them do not come back."""
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
