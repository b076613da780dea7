"""Pure-torch reference of the fused decode step (`triton_decode.py` has the same signature)."""

from __future__ import annotations

import torch

from h2o_kernels.reference import lowest_outside_recent, rotate, rows


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    key_positions: torch.Tensor,
    rank: torch.Tensor,
    token_index: torch.Tensor,
    query_position: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    scaling: float,
    scores: torch.Tensor,
    recent_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode query per head over the slot cache; scores are accumulated in place.

    query: [n_heads, head_dim] unrotated; keys, values: [n_kv_heads, slots, head_dim] unrotated.
    valid: [n_kv_heads, slots] bool (the set E_q); key_positions, rank, token_index: [n_kv_heads, slots] int64.
    cos_table, sin_table: [positions, head_dim]; the query is rotated at `query_position`,
    key j at key_positions[j].
    scores: [n_kv_heads, slots] float32, gets the probabilities summed over each KV head's query
    heads.
    Returns output [n_heads, head_dim], last_probs [n_kv_heads, slots] (this step's increments) and the
    eviction candidate [n_kv_heads] int64: the slot with the smallest updated score among valid entries with
    rank < recent_rank, ties to the smallest token index (-1 when there is none).
    """
    n_heads, head_dim = query.shape
    n_kv_heads, slots = valid.shape
    group = n_heads // n_kv_heads
    positions = key_positions.clamp_min(0)
    q = rotate(query, cos_table[query_position], sin_table[query_position]).view(n_kv_heads, group, head_dim)
    k = rotate(keys, rows(cos_table, positions), rows(sin_table, positions))
    logits = torch.bmm(q.float(), k.float().transpose(1, 2)) * scaling  # [n_kv, group, slots]
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    output = torch.bmm(probs, values.float()).to(query.dtype).view(n_heads, head_dim)
    increments = probs.sum(dim=1)
    scores += increments
    candidate = lowest_outside_recent(scores, rank, recent_rank, valid)[:, 0]
    return output, increments, candidate
