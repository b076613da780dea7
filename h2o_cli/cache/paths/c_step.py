"""The C step: the torch step as one C call once S is full (`cache_step` in h2o_kernels/step.c, through the
layer's `CStep` buffers, h2o_cli.cache.c_step): the write takes the one hole (or the slot above the packed
entries) and exactly one entry is evicted, by the `kernel_victim` rule."""

from __future__ import annotations

import torch

from h2o_cli.cache.paths.base import Call
from h2o_cli.cache.paths.torch_step import StepPath


class CStepPath(StepPath):
    name = "C step"

    def attend(self, layer, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The layer's R first (`c_recall`: R = ∅, or pass 1 of recall in C), then the query map at the
        query's position (its rank in E_q: S after the write and the fullest head's R; or its token index)
        and one C call (write, attention over S ∪ R, S's scores, eviction). query: [1, n_heads, 1, head_dim]
        rotated by the model. Returns [1, 1, n_heads, head_dim]."""
        store, policy = layer.store, layer.policy
        store.pack()
        most = layer.c_recall(query, call)  # recall slots of the fullest head
        rolling = layer.positions == "rolling"
        position = store.length + most if rolling else store.tokens_seen
        grouped, step_table = layer.step_query(call, query, scaling, position)
        output = layer._c_buffers.run(
            grouped,
            call.keys,
            call.values,
            step_table,
            rolling=layer.placement,
            limit=store.length + 1 - policy.recent_slots,
            decay=policy.decay_per_query,
            entries=position + 1 if rolling else None,
        )
        return output.to(query.dtype).view(1, 1, -1, store.head_dim)


C_STEP = CStepPath()
