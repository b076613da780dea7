"""Decode threads chosen by measurement (h2o_cli.cache.threads): which count each step runs on, what is timed,
that torch's count always comes back, and that generation decodes on the choice."""

from __future__ import annotations

import pytest
import torch

from h2o_cli.cache import H2OCache, threads
from h2o_cli.cache.threads import PROBES, RECHECK, DecodeThreads
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError
from h2o_cli.generation import Sampling, generate_ids


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class FakeClock:
    """A step on `n` threads "takes" `cost[n]` seconds."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.now = cost, 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(chooser: DecodeThreads, clock: FakeClock, count: int) -> list[int]:
    used = []
    for _ in range(count):
        with chooser.step() as n:
            assert torch.get_num_threads() == n
            clock.now += clock.cost[n]
        used.append(n)
        assert torch.get_num_threads() == 2  # torch's count is back after every step
    return used


@pytest.mark.parametrize("faster", [1, 2])
def test_auto_measures_both_then_keeps_the_faster_and_rechecks(two_threads, faster):
    clock = FakeClock({faster: 0.010, 3 - faster: 0.020})
    chooser = DecodeThreads("auto", clock=clock)
    used = run_steps(chooser, clock, 2 * RECHECK)
    assert sorted(used[: 2 * PROBES]) == [1] * PROBES + [2] * PROBES  # both timed PROBES times first
    assert used[0] != used[1]  # alternating, so a drift in load hits both
    assert chooser.chosen == faster
    later = used[2 * PROBES :]
    others = [n for n in later if n != faster]
    assert len(others) == 2  # one re-timing of the other count every RECHECK steps, no more


def test_a_change_of_load_moves_the_choice(two_threads):
    clock = FakeClock({1: 0.010, 2: 0.020})
    chooser = DecodeThreads("auto", clock=clock)
    run_steps(chooser, clock, 2 * PROBES)
    assert chooser.chosen == 1
    clock.cost = {1: 0.050, 2: 0.020}  # one thread now competes with another process
    run_steps(chooser, clock, RECHECK * (PROBES + 1))
    assert chooser.chosen == 2


def test_fixed_count_and_a_single_thread_never_switch(two_threads):
    clock = FakeClock({1: 0.01, 2: 0.01, 3: 0.01})
    assert set(run_steps(DecodeThreads("2", clock=clock), clock, 20)) == {2}
    assert set(run_steps(DecodeThreads("auto", measure=False, clock=clock), clock, 10)) == {2}  # a GPU model
    torch.set_num_threads(1)
    chooser = DecodeThreads("auto", clock=clock)
    for _ in range(5):
        with chooser.step() as n:
            assert n == 1 == torch.get_num_threads()
    assert chooser.chosen == 1


def test_untimed_and_failed_steps_are_not_counted(two_threads):
    clock = FakeClock({1: 0.01, 2: 0.02})
    chooser = DecodeThreads("auto", clock=clock)
    with chooser.step(timed=False):
        clock.now += 5.0  # the first step after a prompt (it packs the cache)
    with pytest.raises(KeyboardInterrupt), chooser.step():
        raise KeyboardInterrupt
    assert torch.get_num_threads() == 2
    assert all(len(timings) == 0 for timings in chooser.samples.values())


@pytest.mark.parametrize("bad", ["0", "-1", "two", ""])
def test_bad_setting_is_a_usage_error(bad):
    with pytest.raises(UsageError, match="--decode-threads"):
        CacheSettings(budget=8, decode_threads=bad)


def test_generation_decodes_on_the_caches_choice(tiny_pair, two_threads, monkeypatch):
    """Every step of `generate_ids` runs inside the cache's chooser; the first is not timed; the tokens are
    the same whatever the thread count (greedy)."""
    _, model = tiny_pair
    prompt = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))

    def answer(setting: str) -> tuple[list[int], DecodeThreads]:
        cache = H2OCache(model, CacheSettings(budget=12, chunk=8, decode_threads=setting))
        with torch.inference_mode():
            logits = model(input_ids=prompt, cache=cache, use_cache=True).logits[0, -1]
            tokens = list(generate_ids(model, cache, logits, Sampling(max_new_tokens=12)))
        return tokens, cache.decode_threads

    seen = []  # the `timed` flag of each step
    step = threads.DecodeThreads.step
    monkeypatch.setattr(
        threads.DecodeThreads, "step", lambda self, timed=True: seen.append(timed) or step(self, timed=timed)
    )
    one, chooser = answer("1")
    assert seen == [False] + [True] * 11 and chooser.steps == 12
    assert answer("auto")[0] == one == answer("2")[0]
    assert torch.get_num_threads() == 2
