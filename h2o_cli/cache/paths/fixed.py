"""The fixed step (h2o_cli.cache.fixed_step says why): the torch step's work in fixed shapes, read from tensors
only, so a whole one-token forward can be captured (`--compile`)."""

from __future__ import annotations

import torch

from h2o_cli.cache.fixed_step import accumulate_fixed, fixed_query
from h2o_cli.cache.paths.base import Call, Path
from h2o_cli.cache.step import step_attention
from h2o_cli.cache.victim import evict_fixed


class FixedStepPath(Path):
    name = "fixed step"
    fixed = True

    def take(self, layer, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict) -> Call:
        """A one-token call's K/V: its token index is the model's `position_ids` (the caller's tensor; no
        counter is read), its key unrotated elementwise."""
        from h2o_cli.errors import UnsupportedModelError

        positions = kwargs.get("position_ids")
        if key_states.shape[2] != 1 or positions is None:
            raise UnsupportedModelError("the fixed step takes one token per call, with its position_ids")
        token = positions.reshape(-1)[-1:]
        cos, sin = layer.rope.rotation(token, key_states.dtype)
        return Call(self.unrotated(layer, key_states, cos, sin), value_states[0], cos, sin, self, token)

    def attend(self, layer, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Write into the lowest free slot, take the layer's R (`fixed_entries`), attend over every slot of S
        (empty ones masked) and R, S's scores, evict where a head passes its budget. query: [1, n_heads, 1,
        head_dim] rotated by the model. Returns [1, 1, n_heads, head_dim]."""
        store, policy = layer.store, layer.policy
        length = store.write_fixed(call.keys, call.values, call.token)  # [n_kv, 1], before the write
        key_positions, position, recalled = layer.fixed_entries(query, call, length)
        cos_table, sin_table, step_table = layer.fixed_tables()
        grouped = fixed_query(
            query, call.cos, call.sin, cos_table, sin_table, position, scaling, store.n_kv_heads
        )
        dtype = grouped.dtype  # float32 for a 16-bit store: its slots and R upcast as they are read
        if recalled is not None:
            recalled = (recalled.keys.to(dtype), recalled.values.to(dtype), recalled.present)
        output, probs = step_attention(
            grouped,
            store.key_states(dtype=dtype),
            store.value_states(dtype=dtype),
            key_positions,
            step_table,
            recalled,
            present=store.valid,
        )
        accumulate_fixed(store, probs[:, :, : store.slots].sum(dim=1), policy.decay_per_query)
        evict_fixed(store, policy, length + 1)
        return output.to(query.dtype).view(1, 1, -1, store.head_dim)


FIXED_STEP = FixedStepPath()
