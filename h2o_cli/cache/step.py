"""The decode step on the torch path: one new token per call, the same attention in far fewer tensor ops.

A decode call is tiny (one query per head), so its cost is the number of ops and the passes over the
`[n_kv_heads, slots, head_dim]` keys, not arithmetic. `H2OLayer` takes this path for a one-token call when
`DecodeMaps.usable` says the rotation allows it; the chunk path (`h2o_kernels.reference.slot_attention`)
stays the reference, and the layer tests compare both against the naive simulation.

What is different, and why each is exact (the same sums, only float rounding differs, ~1e-7):
- RoPE is linear in the rotated vector, so undoing the model's rotation, re-rotating the query at its cache
  position and scaling it are one `[head_dim, head_dim * 2]` matrix, built once per forward pass for all
  layers (`DecodeMaps`), and each layer's query and key need one small matmul each.
- Rotated keys are never formed (see `step_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from h2o_cli.cache.positions import rotate, unrotate
from h2o_cli.cache.threads import torch_threads


def expand(rotated: torch.Tensor) -> torch.Tensor:
    """`[..., head_dim]` → `[..., 2 * head_dim]`: `[q1, -q1, q2, q2]` of a rotated query's halves, the form
    `step_attention` takes (it lines the query up with the key terms `[a·c, b·s, a·s, b·c]`)."""
    first, second = rotated.chunk(2, dim=-1)
    return torch.cat([first, -first, second, second], dim=-1)


def one_thread() -> AbstractContextManager[None]:
    """Run the enclosed torch ops on one thread. A decode step's ops take microseconds each; with more
    threads every op above torch's grain size pays the pool's fork/join (and a sleeping thread's wake-up
    under OMP_WAIT_POLICY=PASSIVE), which costs more than the op. Switching is a store of a number."""
    return torch_threads(1)


class DecodeMaps:
    """The per-forward-pass matrices of the decode step, shared by all layers of a model.

    `cos`, `sin` [1, head_dim] are the model's rotation of the call's one token (`Rope.cos_sin`; the later
    layers of a pass get the very same tensors, so the maps are built by the first layer only).
    """

    def __init__(self) -> None:
        self._cos: torch.Tensor | None = None
        self._unrotation: torch.Tensor | None = None
        self._query: dict[tuple[int, float], torch.Tensor] = {}
        self._table: torch.Tensor | None = None
        self._usable = False
        self._inputs: dict = {}

    def usable(self, cos_table: torch.Tensor, sin_table: torch.Tensor) -> bool:
        """Whether `step_attention`'s half tables hold for these RoPE tables: the rotate_half convention
        with each frequency's cos and sin repeated in both halves of the head dims (every standard RoPE;
        checked once per table, not assumed)."""
        if self._table is not cos_table:
            half = cos_table.shape[-1] // 2
            self._table = cos_table
            self._usable = torch.equal(cos_table[:, :half], cos_table[:, half:]) and torch.equal(
                sin_table[:, :half], sin_table[:, half:]
            )
        return self._usable

    def _for(self, cos: torch.Tensor) -> None:
        if self._cos is not cos:  # a new forward pass
            self._cos, self._unrotation, self._query, self._inputs = cos, None, {}, {}

    def unrotation(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`[head_dim, head_dim]` U with `x @ U == unrotate(x, cos, sin)` (the rows of U are the unit vectors
        unrotated: the map is linear)."""
        self._for(cos)
        if self._unrotation is None:
            eye = torch.eye(cos.shape[-1], dtype=cos.dtype, device=cos.device)
            self._unrotation = unrotate(eye, cos, sin)
        return self._unrotation

    def per_pass(self, cos: torch.Tensor, key, build: Callable[[], object]) -> object:
        """`build()` once per forward pass and `key`: what every layer of a pass shares (the first builds it)."""
        self._for(cos)
        value = self._inputs.get(key)
        if value is None:
            value = self._inputs[key] = build()
        return value

    def query(
        self,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position: int,
        scaling: float,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> torch.Tensor:
        """`[head_dim, 2 * head_dim]` M: `query @ M` is the query unrotated, rotated at `position` (its place
        in the cache), times `scaling`, in `expand`'s form."""
        self._for(cos)
        key = (position, scaling)
        if key not in self._query:
            eye = torch.eye(cos.shape[-1], dtype=cos.dtype, device=cos.device)
            at = slice(position, position + 1)
            rotated = rotate(unrotate(eye, cos, sin), cos_table[at], sin_table[at])
            self._query[key] = expand(rotated) * scaling
        return self._query[key]


def step_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    step_table: torch.Tensor,
    recalled: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    present: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention of one query per head over S's slots, which all hold an entry (the set E_q),
    and, for `recall`, the recall slots R in the same softmax (`h2o`'s step is the case R = ∅). `present`
    [n_kv_heads, n] bool: which of S's slots hold an entry (None: all; the fixed step reads every slot).

    query: [n_kv_heads, group, 2 * head_dim] in `expand`'s form (rotated, scaled); keys, values:
    [n_kv_heads, n, head_dim] unrotated; recalled: None, or R's keys, values [n_kv_heads, r, head_dim]
    (unrotated, read where they lie: no concatenation) and which of its slots hold a token [n_kv_heads, r] bool
    (None: all); key_positions: [n_kv_heads, n + r] int64, S's then R's; step_table: [positions, 2 * head_dim]
    (`Rope.step_table`: row p is [c, s, s, c], the cos and sin of position p over the first half of the dims),
    in the keys' dtype or a narrower one, whose rows read are upcast (the fixed step of a 16-bit store).
    Returns output [n_kv_heads, group, head_dim] and probabilities [n_kv_heads, group, n + r] (float32; an empty
    slot gets 0). The C step (h2o_kernels/step.c) is its twin.
    """
    n_kv_heads, n, head_dim = keys.shape
    total = key_positions.shape[1]
    # Why the rotated keys are not needed: a key with halves a, b rotated at a position whose half-dim
    # cos, sin are c, s is (a·c - b·s, b·c + a·s), so its dot product with a query's halves q1, q2 is
    # [q1, -q1]·[a·c, b·s] + [q2, q2]·[a·s, b·c]. The key's row [c, s, s, c] times [a, b] twice gives those
    # terms, and the bmm with the expanded query sums them: one gather and an in-place multiply instead
    # of two gathers and the rotation's five element-wise passes.
    terms = step_table.index_select(0, key_positions.reshape(-1)).view(n_kv_heads, total, 2, head_dim)
    if terms.dtype != keys.dtype:  # the fixed step of a 16-bit store: 16-bit table rows, float32 keys
        terms = terms.to(keys.dtype)
    if recalled is None:
        terms.mul_(keys.unsqueeze(2))  # [a·c, b·s] and [a·s, b·c] of each key
    else:
        terms[:, :n].mul_(keys.unsqueeze(2))
        terms[:, n:].mul_(recalled[0].unsqueeze(2))
    logits = torch.bmm(query, terms.view(n_kv_heads, total, 2 * head_dim).transpose(1, 2))
    if recalled is not None and recalled[2] is not None:
        logits[:, :, n:].masked_fill_(~recalled[2].unsqueeze(1), float("-inf"))
    if present is not None:
        logits[:, :, :n].masked_fill_(~present.unsqueeze(1), float("-inf"))
    probs = torch.softmax(logits.float(), dim=-1)  # [n_kv, group, n + r]
    weights = probs.to(values.dtype)
    if recalled is None:
        return torch.bmm(weights, values), probs
    output = torch.bmm(weights[:, :, :n], values)
    return output.baddbmm_(weights[:, :, n:], recalled[1]), probs
