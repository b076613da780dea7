"""The `recall` policy's one-token step on the torch path, and its statistics kept without host syncs.

`RecallLayer` (h2o_cli.cache) takes this step for a decode call where `H2OLayer` takes its own
(h2o_cli.cache.step): S packed in the lowest slots, RoPE folded into the query's matrix and the keys' rows of
`Rope.step_table`, one thread. What it adds, and why each part is exact (docs/spec.md, recall):
- the page choice is `PageArchive.choose_one`: `choose` for one query, on the ring slots written so far;
- a RAM archive's recalled K/V are read in one row gather per step (the values the recall slots would keep
  for a hit are the archive's own: the same numbers);
- rolling positions rank `E_q = S ∪ R` by token index with one argsort of the `|S| + r` indices; when every
  head's R is full (`recall_is_full`: known from Python counts alone) the query's rank `|S| + r - 1` needs no
  read-back from the tensors;
- attention over S and R is one softmax over both (`recall_step_attention`).

On the CPU with a float32 archive in RAM and a full S, `RecallLayer._native_recall_step` runs the same step as
C calls (h2o_kernels/recall_step.c) with the page bounds still from torch; this module stays the reference the
tests compare it with (tests/test_native_recall.py).
"""

from __future__ import annotations

import torch


class RecallCounts:
    """Tokens recalled and recall hits per step, summed over KV heads: as tensors (or Python ints) until read.

    `add` takes either; nothing is turned into a float before `recalled`, `hits` or the totals are read (the
    panel, `--json`, `archive_summary`), so a step pays no host sync for its statistics."""

    def __init__(self, n_kv_heads: int) -> None:
        self.n_kv_heads = n_kv_heads
        self.reset()

    def reset(self) -> None:
        self._last: tuple = (0, 0)
        self._sums = [[0, 0], [0, 0]]  # recalled, hits: [what came as Python ints, what came as tensors]
        self.steps = 0

    def add(self, recalled, hits) -> None:
        """One step's counts over the KV heads: `recalled` tokens in the recall slots, `hits` of them kept."""
        self._last = (recalled, hits)
        for sums, count in zip(self._sums, self._last, strict=True):
            part = 0 if isinstance(count, int) else 1  # ints add in Python: no tensor op
            sums[part] = sums[part] + count
        self.steps += 1

    def _mean(self, count) -> float:
        return float(count) / self.n_kv_heads

    @property
    def recalled(self) -> float:
        """Tokens recalled per KV head in the last step (the mean over heads)."""
        return self._mean(self._last[0])

    @property
    def hits(self) -> float:
        """Of them, already in the recall slots the step before (not read again)."""
        return self._mean(self._last[1])

    @property
    def recalled_total(self) -> float:
        """`recalled` summed over every step since the start."""
        return self._mean(sum(self._sums[0]))

    @property
    def hits_total(self) -> float:
        return self._mean(sum(self._sums[1]))


def recall_is_full(held: int, length: int, slots: int) -> bool:
    """Whether a one-token step fills all `slots` recall slots of every KV head, from Python counts alone.

    `held` tokens are archived, the step's own (the newest) among them, and S holds `length` entries including
    it: at least `held - length` archived tokens are older than the step and not in S (the candidates)."""
    return held - length >= slots


def rolling_step_positions(
    resident: torch.Tensor, recalled: torch.Tensor, full: bool
) -> tuple[torch.Tensor, int]:
    """Rolling positions of a one-token step: ranks of `E_q = S ∪ R` by token index (docs/spec.md).

    resident: [n_kv_heads, n] token indices of S (every one an entry, the query's token the newest);
    recalled: [n_kv_heads, r] of R (-1 = empty; all present when `full`). Returns the key positions
    [n_kv_heads, n + r] (0 for an empty recall slot) and the query's position. Heads with fewer entries are
    shifted up so every head's query sits at the same position, as the chunk path does."""
    tokens = torch.cat([resident, recalled], dim=1)
    if full:
        entries = tokens.shape[1]
    else:
        tokens.masked_fill_(tokens < 0, torch.iinfo(torch.int64).max)  # empty slots rank last
    order = torch.argsort(tokens, dim=1)
    steps = torch.arange(tokens.shape[1], device=tokens.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, steps)
    if full:
        return rank, entries - 1
    present = recalled >= 0
    counts = present.sum(dim=1, keepdim=True) + resident.shape[1]  # [n_kv, 1] entries of E_q per head
    entries = int(counts.max())  # the one read-back, while some head's R is not full (early in a stream)
    in_set = torch.cat([present.new_ones(resident.shape), present], dim=1)
    return torch.where(in_set, rank + (entries - counts), 0), entries - 1


def recall_step_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    recalled_keys: torch.Tensor,
    recalled_values: torch.Tensor,
    key_positions: torch.Tensor,
    step_table: torch.Tensor,
    present: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h2o_cli.cache.step.step_attention` over `S ∪ R` (one softmax), the recall slots that hold nothing left
    out; S's and R's K/V are read where they lie (no concatenation).

    query: [n_kv_heads, group, 2 * head_dim] (`expand`'s form, rotated, scaled); keys, values:
    [n_kv_heads, n, head_dim] S's entries and recalled_keys, recalled_values: [n_kv_heads, r, head_dim] the
    recall slots, all unrotated; key_positions: [n_kv_heads, n + r] (S's, then R's); present:
    [n_kv_heads, r] bool, or None when every recall slot holds a token. Returns output
    [n_kv_heads, group, head_dim] and probabilities [n_kv_heads, group, n + r] (float32): the softmax over
    exactly the entries present (an empty slot gets probability 0)."""
    n_kv_heads, n, head_dim = keys.shape
    total = key_positions.shape[1]
    terms = step_table.index_select(0, key_positions.reshape(-1)).view(n_kv_heads, total, 2, head_dim)
    terms[:, :n].mul_(keys.unsqueeze(2))  # [a·c, b·s] and [a·s, b·c] of each key (see step_attention)
    terms[:, n:].mul_(recalled_keys.unsqueeze(2))
    logits = torch.bmm(query, terms.view(n_kv_heads, total, 2 * head_dim).transpose(1, 2))
    if present is not None:
        logits[:, :, n:].masked_fill_(~present.unsqueeze(1), float("-inf"))
    probs = torch.softmax(logits.float(), dim=-1)  # [n_kv, group, n + r]
    weights = probs.to(values.dtype)
    output = torch.bmm(weights[:, :, :n], values)
    return output.baddbmm_(weights[:, :, n:], recalled_values), probs
