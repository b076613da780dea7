"""What every path shares: the `Call` a path takes from `update`, and the `Path` base (`take`, `attend`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from h2o_cli.cache.positions import unrotate


@dataclass(slots=True)
class Call:
    """What `update` leaves for `attend`: the call's K/V, unrotated, the model's rotation of it, its path."""

    keys: torch.Tensor  # [n_kv_heads, chunk, head_dim]
    values: torch.Tensor
    cos: torch.Tensor  # [chunk, head_dim]
    sin: torch.Tensor
    path: Path
    token: torch.Tensor | None = None  # [1] int64, the token's index (the fixed step's, from position_ids)

    @property
    def chunk(self) -> int:
        return self.keys.shape[1]


class Path:
    """One way through a layer. `take` turns the model's rotated K/V into a `Call` (keys unrotated); `attend`
    writes them into the store, attends, accumulates scores and evicts. Paths hold no state: one object each."""

    name = "path"
    one_token = False  # a one-token step (the torch or C step): recall writes its archive row by one C call
    fixed = False  # the fixed step: reads tensors only

    def take(self, layer, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict) -> Call:
        """The call's K/V `[1, n_kv_heads, chunk, head_dim]` (rotated by the model at `position_ids`, default
        the next `chunk` token indices), unrotated with the model's own tables (`Rope.cos_sin`, computed by
        the first layer of a forward pass and reused by the others)."""
        chunk = key_states.shape[2]
        layer.check_room(chunk)
        positions = kwargs.get("position_ids")
        if positions is None:
            seen = layer.store.tokens_seen
            positions = torch.arange(seen, seen + chunk, device=key_states.device)
        elif positions.numel() != chunk:
            positions = positions.reshape(-1)[-chunk:]
        # The same tensor object for every layer of a forward pass, so Rope computes its cos/sin once per pass.
        cos, sin = layer.rope.cos_sin(positions, key_states.dtype, reuse=not layer.first_layer)
        return Call(self.unrotated(layer, key_states, cos, sin), value_states[0], cos, sin, self)

    def unrotated(
        self, layer, key_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The call's keys [n_kv_heads, chunk, head_dim], unrotated elementwise."""
        return unrotate(key_states[0], cos, sin)

    def attend(self, layer, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query: [1, n_heads, chunk, head_dim] rotated by the model. Returns [1, chunk, n_heads, head_dim]."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class Recalled(NamedTuple):
    """A layer's recall slots R as the path bodies read them (R = ∅ is None, not an empty `Recalled`)."""

    keys: torch.Tensor  # [n_kv_heads, r, head_dim], unrotated
    values: torch.Tensor
    present: torch.Tensor | None  # [n_kv_heads, r] bool: which slots hold a token (None: all)
