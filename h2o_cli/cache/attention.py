"""The "h2o" attention function registered with transformers' AttentionInterface."""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from h2o_cli.errors import UnsupportedModelError

NAME = "h2o"


def h2o_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, n_heads, chunk, head_dim] → ([1, chunk, n_heads, head_dim], None). Needs an `H2OCache`."""
    layer = kwargs.get("h2o_layer")
    if layer is None:
        raise UnsupportedModelError(
            "this model uses h2o attention but was called without an H2OCache; pass cache=H2OCache(model, settings)"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return layer.attend(query, scaling), None


def enable(model) -> None:
    """Make `model` use the h2o attention function (registered once per process)."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, h2o_attention)
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
