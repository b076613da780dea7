"""The chunk path on the fused Triton kernels (CUDA, `--kernels triton`): one launch per layer for a decode
token (scores accumulated in place, the eviction candidate found in the same pass), the two-pass prefill
kernel for a chunk. `choose_path` sends a decayed chunk of several tokens to the chunk path instead (the
prefill kernel sums a chunk's probabilities unweighted); a layer with recall slots never comes here."""

from __future__ import annotations

import torch
from h2o_kernels import decode_attention, prefill_attention

from h2o_cli.cache.paths.chunk import ChunkPath
from h2o_cli.cache.victim import one_over_by_kernel_rule


class TritonPath(ChunkPath):
    name = "triton"

    def attend_written(self, layer, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """As `ChunkPath.attend_written` with R = ∅ (query [n_heads, chunk, head_dim], unrotated)."""
        chunk, store, policy = query.shape[1], layer.store, layer.policy
        key_positions, first_query_position = layer.slot_positions(chunk)
        cos_table, sin_table = layer.rope.table(first_query_position + chunk, query.dtype, query.device)
        kernels = layer.settings.kernels
        if chunk > 1:
            output, increments, last_probs = prefill_attention(
                query, store.key_states(), store.value_states(), store.valid, store.token_index, key_positions,
                store.tokens_seen - chunk, first_query_position, cos_table, sin_table, scaling, kernels=kernels,
            )  # fmt: skip
            store.accumulate(increments, last_probs, chunk)
            store.evict(policy)
            return output.transpose(0, 1).unsqueeze(0)
        if policy.decay_per_query != 1.0:  # the kernel adds this step's probabilities to γ·õ
            store.scores.mul_(policy.decay_per_query)
        by_kernel = one_over_by_kernel_rule(store, policy)
        recent_rank = store.length - policy.recent_slots if by_kernel else 0
        output, increments, candidate = decode_attention(
            query[:, 0], store.key_states(), store.value_states(), store.valid, key_positions, store.rank,
            store.token_index, first_query_position, cos_table, sin_table, scaling, store.scores, recent_rank,
            kernels=kernels,
        )  # fmt: skip
        store.accumulate(increments, increments, chunk, scores_added=True)
        if by_kernel:
            store.drop(candidate.unsqueeze(1))
        else:
            store.evict(policy)
        return output.unsqueeze(0).unsqueeze(0)


TRITON = TritonPath()
