"""The cache's side of `recall`'s C step (h2o_kernels/archive.c and step.c): one `RecallLayer`'s archive and
recall-slot buffers next to its store's (`CStep`), and the calls that run the archive write, the page choice and
the step on them. Every buffer C code reads or writes has its dtype stated (never torch's default, which a
library user may have set to bfloat16) and is checked once per layer (`checked`)."""

from __future__ import annotations

import ctypes

import torch
from h2o_kernels import native, native_archive

from h2o_cli.cache.c_step import CStep, checked

MOST_KV_HEADS = 255  # archive.c counts the heads holding a token in a byte


class RecallCStep(CStep):
    """The fixed arguments of one `RecallLayer`'s C calls: the store's (`CStep`), its archive's and recall
    slots' addresses, and scratch (the archive is a float32 ring, in RAM or a mapped file: its buffers never
    move; a file's pages are released after every call that touches them)."""

    def __init__(self, layer) -> None:
        store, archive = layer.store, layer.archive
        super().__init__(store)
        self.archive = archive
        self.recall_index = layer.recall_index
        self.recall = recall = layer.recall_index.shape[1]
        tensors = checked_buffers(layer, recall)
        self.archive_pointers = tuple(tensor.data_ptr() for tensor in tensors[:3])
        self.recall_pointers = tuple(tensor.data_ptr() for tensor in tensors[3:])
        self.summary_pointer = archive.summary.data_ptr()
        self.store_index_pointers = (store.token_index.data_ptr(), store.valid.data_ptr())
        self.blocked = torch.zeros(archive.capacity, dtype=torch.uint8)  # 0 between calls
        self.held_by = torch.zeros(archive.capacity, dtype=torch.uint8)  # `lead_choose`'s: 0 between calls
        self.previous = torch.full((archive.capacity,), -1, dtype=torch.int64)  # -1 between calls
        self.pages = torch.empty(archive.pages, 2, dtype=torch.int64)
        self.chosen = torch.empty(max(recall, 1), dtype=torch.int64)
        self.moved = torch.empty(2, max(recall, 1), store.head_dim, dtype=torch.float32)  # the slots' new K/V
        self.per_page = torch.zeros(2, archive.pages, dtype=torch.int64)  # archived, marked (0 between calls)
        self.choose_scratch = tuple(
            tensor.data_ptr()
            for tensor in (self.blocked, self.previous, self.pages, self.chosen, self.moved, self.per_page)
        )
        self.counts = torch.zeros(store.n_kv_heads, dtype=torch.int64)
        self.totals = (ctypes.c_int64 * 2)()  # read without a tensor op: recalled, the most of one head
        self.order = torch.empty(2 * store.slots + 3 * recall, dtype=torch.int64)
        self.recall_arguments = (recall, *self.recall_pointers, self.counts.data_ptr(), self.order.data_ptr())
        self.scores = StepScores(archive)  # `PageArchive.step_bounds`, in C where it can
        self.taken = torch.empty(0, dtype=torch.int64)  # `lead_choose`'s: the lead's pages it takes

    def nbytes(self) -> int:
        """Bytes of these buffers and scratch (the store's step scratch, the choice's, `StepScores.nbytes`)."""
        buffers = (self.scratch, self.victims, self.blocked, self.held_by, self.previous, self.pages, self.chosen,
                   self.moved, self.per_page, self.counts, self.order, self.taken)  # fmt: skip
        return sum(tensor.nbytes for tensor in buffers) + self.scores.nbytes()

    def archive_tokens(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`PageArchive.write` of a step's token or a chunk's: keys, values [n_kv_heads, n, head_dim] unrotated
        (float32 here), in one C call that writes them token by token (a file archive's disk reserved first,
        and the pages written through the mapping released after)."""
        archive = self.archive
        count = keys.shape[1]
        archive.prepare_write(count)
        native_archive.archive_tokens(
            keys.float(), values.float(), archive.capacity, archive.page_size, archive.block_size, archive.tokens,
            self.archive_pointers, self.summary_pointer,
        )  # fmt: skip
        archive.tokens += count
        archive.release()

    def choose(self, bound: torch.Tensor) -> tuple[int, int]:
        """Pass 1 of a one-token step from the page bounds on: `PageArchive.choose_one` and the read into the
        recall slots, for the token the step is about to write (`store.tokens_seen`, already archived).
        bound: [n_kv_heads, used pages] float32 (`PageArchive.step_bounds`). Returns (tokens recalled, hits),
        summed over KV heads; `counts` holds each head's, `most` the most of one head."""
        store, archive = self.store, self.archive
        hits = native_archive.archive_choose(
            bound, store.head_dim, self.store_index_pointers, store.slots, store.active, store.tokens_seen,
            archive.capacity, archive.page_size, self.archive_pointers, self.recall, self.recall_pointers,
            self.choose_scratch, self.counts, self.totals,
        )  # fmt: skip
        archive.release()
        return self.totals[0], hits

    def lead_choose(self, ranked: torch.Tensor, pages: int) -> tuple[int, int]:
        """`choose` under a lead head: `LeadRanking.choose` and the read into the recall slots, from the lead's
        ranking `ranked` ([n] int64 ring pages, best first: `LeadRanking.ranked`) and its page count `pages`.
        Returns (tokens recalled, hits) summed over KV heads; `counts` and `most` as `choose`'s."""
        store, archive = self.store, self.archive
        if self.taken.numel() < pages:
            self.taken = torch.empty(pages, dtype=torch.int64)
        blocked, previous, _, chosen, moved, per_page = self.choose_scratch
        marked = per_page + archive.pages * self.per_page.itemsize  # its second row
        hits = native_archive.archive_lead_choose(
            store.head_dim, self.store_index_pointers, store.slots, store.active, store.tokens_seen,
            archive.capacity, archive.page_size, archive.span // archive.page_size, self.archive_pointers,
            ranked, pages, self.recall, self.recall_pointers,
            (self.held_by.data_ptr(), blocked, previous, self.taken.data_ptr(), chosen, moved, marked),
            self.counts, self.totals,
        )  # fmt: skip
        archive.release()
        return self.totals[0], hits

    @property
    def most(self) -> int:
        """Recall slots filled in the fullest head by the last `choose`."""
        return self.totals[1]

    def run(self, query, key, value, table, rolling, limit, decay, entries=None) -> torch.Tensor:
        """`CStep.run` over S and the recall slots (`entries`: the query's position + 1 with rolling
        positions)."""
        return super().run(query, key, value, table, rolling, limit, decay, self.recall_arguments, entries)


def checked_buffers(layer, recall: int) -> tuple[torch.Tensor, ...]:
    """The archive's token index, keys and values and the recall slots' keys, values and token indices of
    `layer`, each checked (`checked`: dtype, shape, contiguous CPU), and its summaries; raises ValueError for
    any the C calls cannot take (they would read or write past it)."""
    store, archive = layer.store, layer.archive
    n_kv, head_dim, capacity = store.n_kv_heads, store.head_dim, archive.capacity
    if not 0 < n_kv <= MOST_KV_HEADS or capacity % archive.page_size or capacity % archive.block_size:
        raise ValueError(
            f"the C recall step takes 1 to {MOST_KV_HEADS} KV heads and whole pages and blocks; got {n_kv} heads, "
            f"capacity {capacity}, pages of {archive.page_size}, blocks of {archive.block_size}"
        )
    held, slots = (n_kv, capacity, head_dim), (n_kv, recall, head_dim)
    summary = (n_kv, capacity // archive.block_size, 2 * head_dim)
    checked("the archive's summaries", archive.summary, torch.float32, summary)
    return (
        checked("the archive's token index", archive.token_index, torch.int64, (capacity,)),
        checked("the archive's keys", archive.keys, torch.float32, held),
        checked("the archive's values", archive.values, torch.float32, held),
        checked("the recall keys", layer.recall_keys, torch.float32, slots),
        checked("the recall values", layer.recall_values, torch.float32, slots),
        checked("the recall token indices", layer.recall_index, torch.int64, (n_kv, recall)),
    )


class StepScores:
    """A one-token step's page scores on a float32 CPU archive (in RAM or a mapped file): `PageArchive.step_bounds`,
    in one C call (archive.c's `archive_step_scores`) when the step scores the `step_shortlist` pages its
    carried scores rank best, or every page while there are no more (`PageArchive.steps_score_carried_shortlist`),
    else (or where the build has no half precision: `native.has_step_scores`) by torch. The C call returns the
    same pages and scores to float rounding; the shortlist's keys are held here between steps in half precision
    (the step's mass is over keys rounded to it, `archive.as_held`), one page per column, and only pages new
    to the shortlist or written since are read.
    Held keys and scratch are made on the first C call and again after the archive is reset or rewound."""

    def __init__(self, archive) -> None:
        n_kv, capacity, head_dim = archive.n_kv_heads, archive.capacity, archive.head_dim
        checked("the archive's keys", archive.keys, torch.float32, (n_kv, capacity, head_dim))
        checked("the archive's token index", archive.token_index, torch.int64, (capacity,))
        checked("the carried scores", archive.carried, torch.float32, (n_kv, archive.pages))
        checked("the carried pages' starts", archive.carried_start, torch.int64, (archive.pages,))
        self.archive = archive
        self.archive_pointers = (archive.token_index.data_ptr(), archive.keys.data_ptr())
        self.carried_pointers = (archive.carried.data_ptr(), archive.carried_start.data_ptr())
        self._held = None  # (archive epoch, the tensors, their addresses)

    def nbytes(self) -> int:
        """Bytes held: the shortlist's keys (n_kv_heads x step_shortlist x page_size x head_dim, 2 bytes each
        in half precision) and scratch; 0 before the first C call."""
        return 0 if self._held is None else sum(tensor.nbytes for tensor in self._held[1])

    def bounds(self, query: torch.Tensor) -> torch.Tensor:
        """query: [n_kv_heads, group, head_dim] float32, unrotated. Returns [n_kv_heads, used pages] float32."""
        archive, (n_kv, group, head_dim) = self.archive, query.shape
        if not archive.steps_score_carried_shortlist() or not native.has_step_scores():
            return archive.step_bounds(query)
        shortlist, size, ring = archive.step_shortlist, archive.page_size, archive.pages
        if self._held is None or self._held[0] != archive.epoch:
            tensors = (
                torch.full((n_kv, shortlist), -1, dtype=torch.int64),  # each column's ring page
                torch.full((n_kv, ring), -1, dtype=torch.int64),  # each ring page's column
                torch.full((1,), -1, dtype=torch.int64),  # archive tokens when brought up to date
                torch.empty(n_kv, shortlist * size, head_dim, dtype=torch.float16),  # the keys
                torch.empty(ring, 2, dtype=torch.int64),  # scratch: the ranking
                torch.zeros(ring, dtype=torch.uint8),  # the shortlist's pages (0 between calls)
                torch.empty(group, shortlist * size, dtype=torch.float32),  # the logits
                torch.empty(
                    group * head_dim + shortlist, dtype=torch.float32
                ),  # the scaled queries, each column's mass
            )
            self._held = (archive.epoch, tensors, tuple(tensor.data_ptr() for tensor in tensors))
        used = archive.span // size
        bound = torch.empty(n_kv, used, dtype=torch.float32)
        pointers = self._held[2]
        native_archive.archive_step_scores(
            query, archive.capacity, size, used, shortlist, archive.carry, head_dim**-0.5, archive.tokens,
            self.archive_pointers, self.carried_pointers, pointers[:4], pointers[4:], bound,
        )  # fmt: skip
        archive.scored += 1
        archive.release()
        return bound
