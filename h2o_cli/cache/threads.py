"""Threads per phase: a prefill chunk runs on torch's thread count; decode steps on the count that measured
fastest (`--decode-threads auto`, the default) or on a fixed one.

A chunk is matrix-matrix work and gains from every core. A decode step of a small model is some 300 small
matrix-vector products and cache calls per token: each op parallelised over several threads pays the pool's
fork/join (and, under `OMP_WAIT_POLICY=PASSIVE` or on a busy machine, a sleeping thread's wake-up), so two threads
can decode slower than one (docs/benchmarks.md). Which wins depends on the model, the CPU and what else runs,
so `auto` measures instead of guessing: the first decode steps alternate between one thread and torch's count,
then the faster (median of the last `PROBES` steps each) is used, and every `RECHECK` steps the other is timed
once more, so a change of load moves the choice.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from h2o_cli.config import check_decode_threads

PROBES = 3  # timed steps of each candidate before a choice
RECHECK = 64  # steps between two timings of the candidate not chosen


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the enclosed torch ops on `count` threads; torch's count is restored after (also on an error)."""
    before = torch.get_num_threads()
    if count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class DecodeThreads:
    """Chooses the torch thread count of each decode step (`step`); one per cache, so the choice outlives a
    chat turn. `measure=False` (a GPU model): `auto` keeps torch's count. `clock` is for tests."""

    def __init__(
        self, setting: str = "auto", measure: bool = True, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        check_decode_threads(setting)
        self.setting = setting
        self.measure = measure
        self.clock = clock
        self.samples: dict[int, deque[float]] = {}
        self.steps = 0

    def candidates(self, configured: int) -> list[int]:
        """The counts to try when torch is set to `configured` threads."""
        if self.setting != "auto":
            return [int(self.setting)]
        return sorted({1, configured}) if self.measure else [configured]

    def timings(self, threads: int) -> deque[float]:
        return self.samples.setdefault(threads, deque(maxlen=PROBES))

    def fastest(self, options: list[int]) -> int | None:
        """The candidate with the lowest median step time, once every candidate has `PROBES` timings."""
        if any(len(self.timings(n)) < PROBES for n in options):
            return None
        return min(options, key=lambda n: statistics.median(self.timings(n)))

    def pick(self, configured: int) -> int:
        options = self.candidates(configured)
        if len(options) == 1:
            return options[0]
        best = self.fastest(options)
        if best is None:  # still measuring: the candidate with the fewest timings (so they alternate)
            return min(options, key=lambda n: len(self.timings(n)))
        if self.steps % RECHECK == RECHECK - 1:
            return next(n for n in options if n != best)
        return best

    @property
    def chosen(self) -> int | None:
        """The count decode steps use now (None while still measuring, or before any step)."""
        configured = torch.get_num_threads()
        options = self.candidates(configured)
        return options[0] if len(options) == 1 else self.fastest(options)

    @contextmanager
    def step(self, timed: bool = True) -> Iterator[int]:
        """Run the enclosed decode step on the chosen thread count (torch's count is restored after).
        `timed=False`: a step that is not typical (the first after a prefill packs the cache) is not
        counted."""
        threads = self.pick(torch.get_num_threads())
        started = self.clock()
        with torch_threads(threads):
            yield threads
        elapsed = self.clock() - started  # only a step that finished is counted
        self.steps += 1
        if timed:
            self.timings(threads).append(elapsed)
