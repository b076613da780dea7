"""Typed wrappers of archive.c (`recall`'s archive write and page choice: `archive_tokens`,
`archive_choose`, `archive_lead_choose`, `archive_step_scores`) over the library `native` builds and loads. They
take tensors, addresses and sizes, never a cache object (h2o_cli/cache/recall/c_step.py holds the buffers)."""

from __future__ import annotations

import torch

from h2o_kernels.native import library


def archive_tokens(
    keys: torch.Tensor,
    values: torch.Tensor,
    capacity: int,
    page_size: int,
    block_size: int,
    first: int,
    archive: tuple[int, ...],
    summary: int,
) -> None:
    """`PageArchive.write` of a step's token or a chunk's (archive.c's `archive_tokens`): keys, values
    [n_kv_heads, n, head_dim] unrotated float32, the tokens `first` .. `first + n - 1`, written one after the
    other; archive: the addresses of the archive's token index [capacity] (int64), keys and values
    [n_kv_heads, capacity, head_dim] (float32); summary: the address of its block summaries
    [n_kv_heads, capacity / block_size, 2 * head_dim] (float32)."""
    n_kv, count, head_dim = keys.shape
    keys, values = keys.contiguous(), values.contiguous()
    library().archive_tokens(
        n_kv, head_dim, count, capacity, page_size, block_size, first, keys.data_ptr(), values.data_ptr(),
        *archive, summary,
    )  # fmt: skip


def archive_choose(
    bound: torch.Tensor,
    head_dim: int,
    store: tuple[int, int],
    slots: int,
    active: int,
    new_token: int,
    capacity: int,
    page_size: int,
    archive: tuple[int, ...],
    recall: int,
    recall_slots: tuple[int, ...],
    scratch: tuple[int, ...],
    counts: torch.Tensor,
    totals,
) -> int:
    """Pass 1 of a one-token recall step from the page bounds on (archive.c's `archive_choose`):
    `PageArchive.choose_one` and the read into the recall slots, for the token the step is about to write
    (`new_token`, already archived). bound: [n_kv_heads, used pages] float32 (`best_page_bound`); store: the
    addresses of the store's token_index (int64) and valid (bool) [n_kv_heads, slots], entries below
    `active`; archive: as `archive_tokens`'s; recall_slots: the addresses of the `recall` slots' keys, values
    [n_kv_heads, recall, head_dim] (float32) and token indices [n_kv_heads, recall] (int64); scratch: the
    addresses of [capacity] uint8 (0 everywhere between calls), [capacity] int64 (-1 everywhere between
    calls), [pages, 2] int64, [max(recall, 1)] int64, [2, max(recall, 1), head_dim] float32 and [2, pages]
    int64 (its second row 0 between calls) buffers. Fills counts [n_kv_heads] int64 (each head's recalled
    tokens) and totals (a ctypes int64[2]: their sum, and the most of one head). Returns the hits summed over KV heads."""
    n_kv, used = bound.shape
    bound = bound.contiguous()
    return library().archive_choose(
        n_kv, head_dim, slots, active, *store, new_token, capacity, page_size, used,
        *archive, bound.data_ptr(), recall, *recall_slots, *scratch, counts.data_ptr(), totals,
    )  # fmt: skip


def archive_lead_choose(
    head_dim: int,
    store: tuple[int, int],
    slots: int,
    active: int,
    new_token: int,
    capacity: int,
    page_size: int,
    used: int,
    archive: tuple[int, ...],
    ranked: torch.Tensor,
    lead_pages: int,
    recall: int,
    recall_slots: tuple[int, ...],
    scratch: tuple[int, ...],
    counts: torch.Tensor,
    totals,
) -> int:
    """Pass 1 of a one-token recall step under a lead head (archive.c's `archive_lead_choose`):
    `LeadRanking.choose` and the read into the recall slots, for the token the step is about to write
    (`new_token`, already archived). ranked: [n] int64, the lead's ring pages with a written first slot and a
    positive score, best first (`LeadRanking.ranked`); `used`: the ring pages this archive has written; store,
    archive, recall_slots, counts and totals as `archive_choose`'s; scratch: the addresses of [capacity] uint8
    (0 between calls), [capacity] uint8 (0 between calls), [capacity] int64 (-1 between calls),
    [lead_pages] int64, [max(recall, 1)] int64, [2, max(recall, 1), head_dim] float32 and [pages] int64 (0
    between calls) buffers. Returns the hits summed over KV heads."""
    n_kv = counts.shape[0]
    if not (n_kv <= 255 and ranked.dtype == torch.int64 and ranked.is_contiguous()):  # read as int64 [n]
        raise ValueError(
            f"archive_lead_choose takes at most 255 KV heads and contiguous int64 pages; got {n_kv}, {ranked.dtype}"
        )
    return library().archive_lead_choose(
        n_kv, head_dim, slots, active, *store, new_token, capacity, page_size, used,
        *archive, ranked.data_ptr(), ranked.numel(), lead_pages, recall, *recall_slots, *scratch,
        counts.data_ptr(), totals,
    )  # fmt: skip


def archive_step_scores(
    query: torch.Tensor,
    capacity: int,
    page_size: int,
    used: int,
    shortlist: int,
    carry: float,
    scale: float,
    tokens: int,
    archive: tuple[int, int],
    carried: tuple[int, int],
    held: tuple[int, ...],
    scratch: tuple[int, ...],
    bound: torch.Tensor,
) -> None:
    """A one-token step's page scores with carried scores and a shortlist (archive.c's `archive_step_scores`,
    which states the contract). query: [n_kv_heads, group, head_dim] float32, unscaled; archive: the addresses
    of the archive's token index [capacity] (int64) and keys [n_kv_heads, capacity, head_dim] (float32);
    carried: of its carried scores [n_kv_heads, ring pages] (float32) and their pages' starts [ring pages]
    (int64); held: of the held pages [n_kv_heads, shortlist], the held columns [n_kv_heads, ring pages], the
    tokens then [1] (int64) and the held keys [n_kv_heads, shortlist * page_size, head_dim] (float16); scratch: of
    [used, 2] int64, [ring pages] uint8 (0 between calls), [group, shortlist * page_size] and
    [group * head_dim + shortlist] float32 buffers. Writes bound [n_kv_heads, used] float32."""
    n_kv, group, head_dim = query.shape
    query = query.contiguous()
    library().archive_step_scores(
        n_kv, group, head_dim, capacity, page_size, used, shortlist, carry, scale, tokens,
        query.data_ptr(), *archive, *carried, *held, *scratch, bound.data_ptr(),
    )  # fmt: skip
