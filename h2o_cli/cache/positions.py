"""Rotary positions for the slot cache: undo the model's rotation, re-apply it at original or rolling positions.

Rolling positions (SPEC.md): inside a KV head the entries a query sees are ranked by token index; each key
uses its rank as position and the query uses its own rank. Keys are stored without rotation, so no stale
rotation survives an eviction.
"""

from __future__ import annotations

import torch

from h2o_cli.errors import UnsupportedModelError


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply the rotation (cos, sin broadcast against x's last dims)."""
    return x * cos + rotate_half(x) * sin


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `rotate` for a pure rotation (cos² + sin² = 1)."""
    return x * cos - rotate_half(x) * sin


class Rope:
    """The model's own rotary embedding, as pure rotation tables indexed by position.

    `rotary_emb` is the model's module (`model.model.rotary_emb`); its `attention_scaling` factor is already
    in the model's rotated q and k, so the tables here are divided by it and only ever rotate. `layer_type`:
    for a module that keeps one rotation per attention kind (Gemma 3's `sliding_attention` and
    `full_attention`, each with its own base), the kind whose rotation this is; None for a single one.
    """

    def __init__(self, rotary_emb: torch.nn.Module, head_dim: int, layer_type: str | None = None) -> None:
        rope_type = getattr(rotary_emb, "rope_type", "default")
        if isinstance(rope_type, dict):  # one per layer type
            rope_type = rope_type.get(layer_type, "default")
        if rope_type == "dynamic":
            raise UnsupportedModelError(
                "dynamic RoPE scaling changes frequencies with length and cannot be re-rotated; "
                "use a model with static RoPE"
            )
        self.rotary_emb = rotary_emb
        self.head_dim = head_dim
        self.layer_type = layer_type
        scaling = getattr(rotary_emb, f"{layer_type}_attention_scaling", None) if layer_type else None
        self.scaling = float(
            scaling if scaling is not None else getattr(rotary_emb, "attention_scaling", 1.0)
        )
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._step: torch.Tensor | None = None  # `step_table` of the current tables, built on demand
        self._mean: tuple | None = None  # ((low, high, device), cos, sin) of the last `mean_rotation`
        # (positions tensor, dtype, cos, sin) of the last call that computed them.
        self._last: tuple | None = None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, reuse: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pure rotation for `positions` [n] → cos, sin [n, head_dim] in `dtype`.

        `reuse`: return the last answer if it was for this very tensor object. Only for the later layers of
        one forward pass, which get the tensor the first layer got: identity says nothing about the values
        across passes (a caller may rewrite its position tensor in place, and inference tensors have no
        version counter to tell), so the first layer of every pass computes afresh.
        """
        last = self._last
        if reuse and last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos, sin = self.rotation(positions, dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` without keeping the answer: cos, sin [n, head_dim] for `positions` [n]."""
        dummy = torch.empty(0, dtype=dtype, device=positions.device)
        kind = () if self.layer_type is None else (self.layer_type,)
        cos, sin = self.rotary_emb(dummy, positions.reshape(1, -1), *kind)
        if cos.shape[-1] != self.head_dim:
            raise UnsupportedModelError(
                f"rotary dimension {cos.shape[-1]} differs from head_dim {self.head_dim} (partial RoPE) "
                "and is not supported by the H2O cache"
            )
        if self.scaling != 1.0:
            cos, sin = cos / self.scaling, sin / self.scaling
        return cos[0].to(dtype), sin[0].to(dtype)

    def mean_rotation(self, low: int, high: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [head_dim] (float32) averaged over positions `low .. high-1`.

        RoPE's logit of a query and a key `d` positions apart is `rotate(q, cos_d, sin_d) . k` (q and k
        unrotated), linear in the rotation, so `rotate(q, *mean_rotation(low, high)) . k` is that logit's mean
        over the distances `low .. high-1`: what `recall`'s positional page score bounds (docs/spec.md).
        Kept for the last range asked (every layer of a step asks the same one)."""
        key = (low, high, device)
        if self._mean is None or self._mean[0] != key:
            cos, sin = self.rotation(torch.arange(low, high, device=device), torch.float32)
            self._mean = (key, cos.double().mean(dim=0).float(), sin.double().mean(dim=0).float())
        return self._mean[1], self._mean[2]

    def table(
        self, length: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables cos, sin [>= length, head_dim] for positions 0 .. length-1, grown on demand, never shrunk."""
        if self._cos.shape[0] < length or self._cos.dtype != dtype or self._cos.device != device:
            size = max(length, 2 * self._cos.shape[0])
            self._cos, self._sin = self.cos_sin(torch.arange(size, device=device), dtype)
            self._last, self._step = None, None
        return self._cos, self._sin

    def step_table(self, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[>= length, 2 * head_dim] for `h2o_cli.cache.step`: row p is [c, s, s, c], the cos and sin of
        position p over the first half of the dims (valid where `DecodeMaps.usable(*self.table(...))`)."""
        cos, sin = self.table(length, dtype, device)
        if self._step is None:
            half = self.head_dim // 2
            cos, sin = cos[:, :half], sin[:, :half]
            self._step = torch.cat([cos, sin, sin, cos], dim=1)
        return self._step


# Added to the sort key of the recalled entries and the recent ones: token indices stay far below it.
_AFTER = 1 << 46


def placed_order(token_index: torch.Tensor, recalled: int, recent_from: int | torch.Tensor) -> torch.Tensor:
    """The sort key that `rolling_positions` ranks E_q = S ∪ R by under `--recall-place contiguous`
    (docs/spec.md, recall): S's entries older than `recent_from` (the kept early tokens and heavy hitters)
    first, then R, then S's entries from `recent_from` on (the recent window and the call's own tokens), each
    part in token order. Every recalled token is older than `recent_from` (S holds every newer token), so
    adding one offset to R and to the recent part puts R between the two.

    token_index: [n_kv_heads, n] int64, S's columns first and the `recalled` columns of R last (any value
    where absent); `recent_from`: a token index (int or 0-d tensor). Returns [n_kv_heads, n] int64."""
    later = token_index >= recent_from
    later[:, token_index.shape[1] - recalled :] = True
    return token_index + later * _AFTER


def rolling_positions(
    token_index: torch.Tensor, present: torch.Tensor | None, read_back: bool = True
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """Rolling positions over a set of entries per KV head (docs/spec.md): each entry's rank by token index
    among the entries present, heads with fewer entries shifted up so that every head's newest entry sits at
    the same position (RoPE logits depend only on the distance, which stays the rank's).

    token_index: [n_kv_heads, n] int64; present: [n_kv_heads, n] bool, the columns that hold an entry (None:
    every one, then no shift and no read back). Returns the positions [n_kv_heads, n] (0 where absent) and the
    entries of the fullest head (the newest entry's position + 1): a Python int, or with `read_back` False a
    0-d tensor (the fixed step reads nothing back). The C step's merge is its twin (step.c)."""
    if present is not None:
        token_index = token_index.masked_fill(~present, torch.iinfo(torch.int64).max)  # absent: ranked last
    order = torch.argsort(token_index, dim=1)
    if read_back:
        steps = torch.arange(order.shape[1], device=order.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(1, order, steps)
    else:  # the fixed step: the same inverse permutation, as inductor compiles it right (torch 2.13 on the
        rank = torch.argsort(order, dim=1)  # CPU compiled the scatter so that it overwrote S's token indices)
    if present is None:
        return rank, order.shape[1]
    counts = present.sum(dim=1, keepdim=True)  # [n_kv, 1] entries per head
    most = counts.max()
    # A read back (unless `read_back` is False): only while some head holds fewer entries than another can.
    entries = int(most) if read_back else most
    return torch.where(present, rank + (entries - counts), 0), entries
