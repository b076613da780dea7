"""The `recall` policy's one-token step on the torch path, and its statistics kept without host syncs.

`RecallLayer` (h2o_cli.cache) takes this step for a decode call where `H2OLayer` takes its own
(h2o_cli.cache.step): S packed in the lowest slots, RoPE folded into the query's matrix and the keys' rows of
`Rope.step_table`, one thread. What it adds, and why each part is exact (docs/spec.md, recall):
- the page choice is `PageArchive.choose_one`: `choose` for one query, on the ring slots written so far;
- a RAM archive's recalled K/V are read in one row gather per step (the values the recall slots would keep
  for a hit are the archive's own: the same numbers);
- rolling positions rank `E_q = S ∪ R` by token index with one argsort of the `|S| + r` indices
  (`h2o_cli.cache.positions.rolling_positions`); when every head's R is full (`recall_is_full`: known from
  Python counts alone) the query's rank `|S| + r - 1` needs no read-back from the tensors;
- attention over S and R is one softmax over both (`h2o_cli.cache.step.step_attention` with R).

On the CPU with a float32 archive (in RAM or a file) and a full S, `RecallLayer._c_step` runs the same step as C calls
(h2o_kernels/archive.c and step.c) with the page bounds still from torch; the torch step stays the reference the
tests compare it with (tests/test_native_recall.py).
"""

from __future__ import annotations

import torch

from h2o_cli.cache.positions import placed_order, rolling_positions


class RecallCounts:
    """Tokens recalled and recall hits per step, summed over KV heads: as tensors (or Python ints) until read.

    `add` takes either; nothing is turned into a float before `recalled`, `hits` or the totals are read (the
    panel, `--json`, `archive_summary`), so a step pays no host sync for its statistics."""

    def __init__(self, n_kv_heads: int) -> None:
        self.n_kv_heads = n_kv_heads
        self._fixed: torch.Tensor | None = None  # `fix`: the fixed step's counts, kept on the device
        self.reset()

    def reset(self) -> None:
        self._last: tuple = (0, 0)
        self._sums = [[0, 0], [0, 0]]  # recalled, hits: [what came as Python ints, what came as tensors]
        self.steps = 0
        if self._fixed is not None:
            self._fixed.zero_()

    def fix(self, device: torch.device) -> None:
        """Keep room for `add_fixed`: [last recalled, last hits, recalled total, hits total] on `device`."""
        if self._fixed is None:
            self._fixed = torch.zeros(4, dtype=torch.int64, device=device)
            self._fixed_last = (self._fixed[0], self._fixed[1])

    def add_fixed(self, recalled: torch.Tensor, hits: torch.Tensor) -> None:
        """`add` inside a fixed step (0-d int64 tensors): written in place, so a captured step changes no
        Python value; `stepped_fixed` counts the step after it."""
        last = torch.stack([recalled, hits])
        self._fixed[:2].copy_(last)
        self._fixed[2:].add_(last)

    def stepped_fixed(self) -> None:
        self._last = self._fixed_last
        self.steps += 1

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

    def _total(self, which: int):
        total = sum(self._sums[which])
        fixed = self._fixed
        return total if fixed is None else total + fixed[2 + which]

    @property
    def recalled_total(self) -> float:
        """`recalled` summed over every step since the start."""
        return self._mean(self._total(0))

    @property
    def hits_total(self) -> float:
        return self._mean(self._total(1))


def recall_is_full(held: int, length: int, slots: int) -> bool:
    """Whether a one-token step fills all `slots` recall slots of every KV head, from Python counts alone.

    `held` tokens are archived, the step's own (the newest) among them, and S holds `length` entries including
    it: at least `held - length` archived tokens are older than the step and not in S (the candidates)."""
    return held - length >= slots


def rolling_step_positions(
    resident: torch.Tensor, recalled: torch.Tensor, full: bool, recent_from: int | None = None
) -> tuple[torch.Tensor, int]:
    """Rolling positions of a one-token step: `rolling_positions` of `E_q = S ∪ R` (docs/spec.md).

    resident: [n_kv_heads, n] token indices of S (every one an entry, the query's token the newest);
    recalled: [n_kv_heads, r] of R (-1 = empty; all present when `full`, then nothing is read back);
    recent_from: None (E_q ranked by token index), or R placed as one block before S's tokens from this index
    on (`placed_order`, `--recall-place contiguous`). Returns the key positions [n_kv_heads, n + r] (0 for an
    empty recall slot) and the query's position."""
    tokens = torch.cat([resident, recalled], dim=1)
    if recent_from is not None:
        tokens = placed_order(tokens, recalled.shape[1], recent_from)
    present = None
    if not full:
        present = torch.cat([torch.ones_like(resident, dtype=torch.bool), recalled >= 0], dim=1)
    positions, entries = rolling_positions(tokens, present)
    return positions, entries - 1
