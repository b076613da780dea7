"""Paired differences between policies scored on the same examples (h2o_cli/eval/paired.py), checked against
hand-computed cases and independent computations (exact binomial sums, scipy's paired bootstrap)."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from conftest import FIXTURES

from h2o_cli.eval.paired import paired_delta
from h2o_cli.eval.runner import pair_with_full


def outcomes(both: int, lost: int, gained: int, neither: int) -> tuple[list[int], list[int]]:
    """(base, other) per-example correctness with the given counts of each (base, other) pair."""
    pairs = [(1, 1)] * both + [(1, 0)] * lost + [(0, 1)] * gained + [(0, 0)] * neither
    return [a for a, _ in pairs], [b for _, b in pairs]


def exact_mcnemar(lost: int, gained: int) -> float:
    """Two-sided exact McNemar by hand: twice the smaller binomial(lost + gained, 1/2) tail, at most 1."""
    m = lost + gained
    tail = sum(math.comb(m, k) for k in range(min(lost, gained) + 1)) / 2**m
    return min(1.0, 2 * tail)


def test_hand_computed_case():
    # 10 examples: 5 right under both, 1 lost, 4 gained. delta = (4 - 1) / 10.
    # McNemar: 5 discordant, min 1: p = 2 * (C(5,0) + C(5,1)) / 32 = 12 / 32.
    base, other = outcomes(5, 1, 4, 0)
    got = paired_delta(base, other)
    assert (got.n, got.lost, got.gained) == (10, 1, 4)
    assert got.delta == pytest.approx(0.3)
    assert got.p_value == pytest.approx(12 / 32)
    assert got.low <= got.delta <= got.high


def test_all_gained_has_p_two_over_thirty_two():
    # 5 gained, none lost: p = 2 / 32; every resample gains, so the interval lies above zero.
    base, other = outcomes(3, 0, 5, 2)
    got = paired_delta(base, other)
    assert got.p_value == pytest.approx(2 / 32)
    assert got.delta == pytest.approx(0.5) and got.low > 0


def test_agreeing_policies_have_a_zero_interval_and_p_one():
    base, other = outcomes(7, 0, 0, 3)
    got = paired_delta(base, other)
    assert (got.delta, got.low, got.high, got.lost, got.gained, got.p_value) == (0, 0, 0, 0, 0, 1.0)


def test_always_lost_is_minus_one_exactly():
    base, other = outcomes(0, 6, 0, 0)
    got = paired_delta(base, other)
    assert (got.delta, got.low, got.high) == (-1, -1, -1)


@pytest.mark.parametrize(("lost", "gained"), [(0, 1), (3, 9), (12, 7), (20, 20), (1, 30)])
def test_mcnemar_matches_the_exact_binomial_sum(lost, gained):
    base, other = outcomes(100, lost, gained, 50)
    assert paired_delta(base, other).p_value == pytest.approx(exact_mcnemar(lost, gained), rel=1e-9)


@pytest.mark.parametrize(("lost", "gained"), [(10, 25), (30, 12), (4, 4)])
def test_interval_matches_scipys_paired_bootstrap(lost, gained):
    """scipy resamples the example indices itself (another algorithm, another generator): with many resamples
    both percentile intervals land within a resolution step or two (1/n = 0.005) of each other."""
    from scipy.stats import bootstrap

    base, other = outcomes(120, lost, gained, 200 - 120 - lost - gained)
    got = paired_delta(base, other, resamples=20_000)
    reference = bootstrap(
        (np.array(base, float), np.array(other, float)),
        lambda a, b, axis: b.mean(axis=axis) - a.mean(axis=axis),
        paired=True,
        vectorized=True,
        n_resamples=20_000,
        method="percentile",
        random_state=np.random.default_rng(1),
    ).confidence_interval
    assert got.low == pytest.approx(reference.low, abs=0.011)
    assert got.high == pytest.approx(reference.high, abs=0.011)
    # and the interval's width follows the normal approximation of the paired difference
    n, d = 200, (gained - lost) / 200
    se = math.sqrt(((lost + gained) / n - d**2) / n)
    assert got.high - got.low == pytest.approx(2 * 1.96 * se, rel=0.15)


def test_the_interval_depends_on_the_seed_argument_alone():
    """A table is reproducible: with few resamples (so the bootstrap's draws show in the interval) the seeds
    0..3 give four different intervals, and each seed's interval is the same whatever numpy's and Python's
    global random state (an unseeded or global generator would move it)."""
    import random

    base, other = outcomes(50, 13, 21, 16)
    intervals = []
    for seed in range(4):
        np.random.seed(11), random.seed(11)
        first = paired_delta(base, other, resamples=40, seed=seed)
        np.random.seed(12), random.seed(12)
        assert paired_delta(base, other, resamples=40, seed=seed) == first
        intervals.append((first.low, first.high))
    assert len(set(intervals)) == 4


def test_different_examples_are_refused():
    with pytest.raises(ValueError, match="same examples"):
        paired_delta([1, 0, 1], [1, 0])


def test_rows_gain_the_difference_from_full_of_the_same_task():
    full_copa, local_copa = outcomes(3, 1, 2, 4)
    rows = [
        {"task": "copa", "policy": "full", "correct": full_copa},
        {"task": "copa", "policy": "local", "correct": local_copa},
        {"task": "rte", "policy": "local", "correct": [1, 0]},  # no full row for rte: unchanged
        {"task": "needle", "policy": "full", "length": 1000, "depth": "0.5", "correct": [1, 1]},
        {"task": "needle", "policy": "h2o", "length": 1000, "depth": "0.5", "correct": [0, 1]},
        {"task": "needle", "policy": "h2o", "length": 2000, "depth": "0.5", "correct": [0, 0]},
    ]
    pair_with_full(rows)
    assert (
        "delta_vs_full" not in rows[0] and "delta_vs_full" not in rows[2] and "delta_vs_full" not in rows[5]
    )
    assert rows[1]["delta_vs_full"] == pytest.approx(0.1) and rows[1]["discordant"] == [1, 2]
    assert rows[1]["mcnemar_p"] == pytest.approx(exact_mcnemar(1, 2))
    assert rows[1]["delta_low"] <= 0.1 <= rows[1]["delta_high"]
    assert rows[4]["delta_vs_full"] == pytest.approx(-0.5) and rows[4]["discordant"] == [1, 0]


def test_eval_json_rows_carry_per_example_outcomes_and_paired_differences(smollm, monkeypatch, capsys):
    """Through `h2o eval`: each row's `correct` averages to its `acc`, and the local row's difference from full
    is the difference of those accuracies, its discordant counts those of the two lists."""
    from h2o_cli.cli.app import main

    monkeypatch.setattr("h2o_cli.cli.eval.load", lambda *args, **kwargs: smollm)
    monkeypatch.setattr(
        sys, "argv",
        ["h2o", "eval", "piqa", "--data", str(FIXTURES / "tasks" / "piqa" / "valid.jsonl"),
         "--policies", "full,local", "--budget", "0.2", "--json", "--threads", "1"],
    )  # fmt: skip
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    assert done.value.code in (0, None), out.err
    full, local = json.loads(out.out)
    for row in (full, local):
        assert len(row["correct"]) == row["n"] == 6
        assert sum(row["correct"]) / row["n"] == pytest.approx(row["acc"])
    assert "delta_vs_full" not in full
    assert local["delta_vs_full"] == pytest.approx(local["acc"] - full["acc"])
    lost = sum(a and not b for a, b in zip(full["correct"], local["correct"], strict=True))
    gained = sum(b and not a for a, b in zip(full["correct"], local["correct"], strict=True))
    assert local["discordant"] == [lost, gained]
    assert local["mcnemar_p"] == pytest.approx(exact_mcnemar(lost, gained))
    assert local["delta_low"] <= local["delta_vs_full"] <= local["delta_high"]
