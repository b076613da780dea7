"""The torch step: the chunk path's work for one token in far fewer ops (h2o_cli.cache.step says why each is
exact), on one thread. Every slot below `active` holds an entry once the store is packed, so no mask."""

from __future__ import annotations

import torch

from h2o_cli.cache.paths.base import Call, Path
from h2o_cli.cache.step import one_thread, step_attention
from h2o_cli.cache.victim import evict_after_step


class StepPath(Path):
    """What the torch and C steps share: one token, its key unrotated by the layer's step rule
    (`H2OLayer.step_key`), S packed into its lowest slots before the step."""

    one_token = True

    def unrotated(
        self, layer, key_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        return layer.step_key(key_states, cos, sin)


class TorchStep(StepPath):
    name = "torch step"

    def attend(self, layer, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Write the token into the lowest free slot, take the layer's R (`step_entries`: R = ∅, or pass 1 of
        recall), one softmax over S and R (`step_attention`), S's scores, eviction (`evict_after_step`).
        query: [1, n_heads, 1, head_dim] rotated by the model. Returns [1, 1, n_heads, head_dim]."""
        store = layer.store
        with one_thread():
            store.pack()
            store.write(call.keys, call.values)
            # Every slot below `active` holds an entry now: the store was packed and the write filled the lowest
            # free slot. So no mask, clamp or validity test.
            active = store.active
            key_positions, position, recalled = layer.step_entries(query, call)
            grouped, step_table = layer.step_query(call, query, scaling, position)
            output, probs = step_attention(
                grouped,
                store.key_states(active),
                store.value_states(active),
                key_positions,
                step_table,
                recalled,
            )
            increments = store.first_slots(active)["last_probs"]  # one query: its probabilities are the last
            torch.sum(probs[:, :, :active], dim=1, out=increments)  # S only (r = 0 is h2o)
            store.accumulate(increments, increments, 1, decay=layer.policy.decay_per_query)
            evict_after_step(store, layer.policy)
        return output.to(query.dtype).view(1, 1, -1, store.head_dim)


TORCH_STEP = TorchStep()
