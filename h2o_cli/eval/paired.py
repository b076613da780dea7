"""Paired comparison of two policies scored on the same examples: accuracy difference, its 95% interval, and
the discordant counts with McNemar's exact p-value.

Two policies scored on the same prompts are far from independent (most examples are right or wrong under
both), so their Wilson intervals overlapping says little. The paired statistics look only at the examples
where they disagree:

- `delta`: accuracy(other) - accuracy(base) = (gained - lost) / n.
- `low`, `high`: percentile interval of a paired bootstrap over examples (resample n examples with
  replacement, keep each example's pair of outcomes together), with a fixed seed so a table is reproducible.
- `lost`: examples right under `base` and wrong under `other`; `gained`: the reverse.
- `p_value`: McNemar's exact test, two-sided: binomial(lost + gained, 1/2) on `gained`; 1.0 when they
  never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 10_000
SEED = 0


@dataclass(frozen=True)
class PairedDelta:
    n: int
    delta: float
    low: float
    high: float
    lost: int
    gained: int
    p_value: float


def paired_delta(
    base: Sequence[bool | int],
    other: Sequence[bool | int],
    confidence: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> PairedDelta:
    """Paired difference other - base of per-example correctness (same examples, same order)."""
    from scipy.stats import binomtest

    if len(base) != len(other):
        raise ValueError(f"paired outcomes need the same examples: {len(base)} vs {len(other)}")
    n = len(base)
    if n == 0:
        nan = float("nan")
        return PairedDelta(0, nan, nan, nan, 0, 0, nan)
    lost = sum(1 for a, b in zip(base, other, strict=True) if a and not b)
    gained = sum(1 for a, b in zip(base, other, strict=True) if b and not a)
    # Resampling n examples with replacement draws the counts of (lost, gained, agreeing) examples from a
    # multinomial with their observed shares: the same distribution, without an n-wide index per resample.
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, [lost / n, gained / n, (n - lost - gained) / n], size=resamples)
    deltas = (counts[:, 1] - counts[:, 0]) / n
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(deltas, [tail, 100 - tail])
    p_value = binomtest(gained, lost + gained, 0.5).pvalue if lost + gained else 1.0
    return PairedDelta(n, (gained - lost) / n, float(low), float(high), lost, gained, float(p_value))
