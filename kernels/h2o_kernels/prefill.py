"""Pure-torch reference of chunked prefill attention (the Triton kernel in `triton_prefill.py` has this signature)."""

from __future__ import annotations

import torch

from h2o_kernels.reference import rows, slot_attention


def prefill_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    token_index: torch.Tensor,
    key_positions: torch.Tensor,
    first_query_index: int,
    first_query_position: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk of queries over the slot cache, with per-key column sums of the probabilities.

    query: [n_heads, chunk, head_dim] unrotated; keys, values: [n_kv_heads, slots, head_dim] unrotated.
    valid, token_index, key_positions: [n_kv_heads, slots]. Query i is token `first_query_index + i`, sees the
    valid entries with token_index <= its own, and is rotated at `first_query_position + i`.
    Returns output [n_heads, chunk, head_dim], score increments [n_kv_heads, slots] (float32, summed over the
    chunk and the query heads of each KV head) and the last query's probabilities [n_kv_heads, slots].
    """
    chunk = query.shape[1]
    query_index = torch.arange(first_query_index, first_query_index + chunk, device=query.device)
    allowed = valid.unsqueeze(1) & (token_index.unsqueeze(1) <= query_index.view(1, -1, 1))
    positions = key_positions.clamp_min(0)
    query_positions = slice(first_query_position, first_query_position + chunk)
    return slot_attention(
        query,
        keys,
        values,
        allowed,
        cos_table[query_positions],
        sin_table[query_positions],
        rows(cos_table, positions),
        rows(sin_table, positions),
        scaling,
    )
