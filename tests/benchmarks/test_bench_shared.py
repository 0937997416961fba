"""What the benchmarks share: the interleaved timing loop and the fresh-process runner."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from bench.common import timing
from bench.common.meter import MMAP_ENV, MMAP_VALUE
from bench.common.process import (
    RESULT_MARK,
    ProcessFailed,
    marked_results,
    run_isolated,
)


class ScriptedClock:
    """A clock that runs each call and reports the next of the given durations."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds = iter(seconds)
        self.last_host_s = 0.0

    def time(self, fn) -> float:
        fn()
        self.last_host_s = next(self.seconds)
        return self.last_host_s


def test_variants_are_timed_in_turn_after_untimed_warm_up_rounds() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    settled: list[str] = []
    a, b = [3.0, 1.0, 2.0], [10.0, 30.0, 20.0]
    clock = ScriptedClock([t for pair in zip(a, b, strict=True) for t in pair])
    host: dict[str, float] = {}
    medians = timing.time_interleaved(fns, 3, clock, settle=settled.append, warmup=2, host=host)
    assert calls == ["a", "b"] * 5  # two warm-up rounds, then three timed ones
    assert settled == ["a", "b"] * 3  # before every timed call only
    assert medians == {"a": statistics.median(a), "b": statistics.median(b)}
    assert host == medians  # this clock's host time is its time


def test_another_statistic_of_the_repetitions() -> None:
    fns = {"a": lambda: None}
    clock = ScriptedClock([0.5, 0.2, 0.9])
    assert timing.time_interleaved(fns, 3, clock, warmup=0, statistic=min) == {"a": 0.2}


def test_clocks_time_the_call() -> None:
    def spin() -> None:
        sum(range(20_000))

    for clock in (timing.WallClock(), timing.ThreadClock(), timing.DeviceClock("cpu")):
        seconds = clock.time(spin)
        assert seconds > 0 and clock.last_host_s == seconds


def test_a_fresh_process_returns_the_function_result_with_the_malloc_setting(
    monkeypatch,
) -> None:
    monkeypatch.delenv(MMAP_ENV, raising=False)
    assert run_isolated(os.getenv, {"key": MMAP_ENV}) == MMAP_VALUE
    # Unmetered: never the setting, even where this process has it.
    monkeypatch.setenv(MMAP_ENV, MMAP_VALUE)
    assert run_isolated(os.getenv, {"key": MMAP_ENV}, metered=False) is None
    extra = {"OMP_NUM_THREADS": "3"}
    assert run_isolated(os.getenv, {"key": "OMP_NUM_THREADS"}, env=extra) == "3"


def test_a_failing_process_raises_with_its_error() -> None:
    with pytest.raises(ProcessFailed, match="JSONDecodeError") as failure:
        run_isolated(json.loads, {"s": "not json"}, what="decoding")
    assert str(failure.value).startswith("decoding failed (exit status 1)")
    assert not failure.value.killed


def test_results_are_found_by_their_mark_when_ranks_share_a_line():
    """Two torchrun ranks share one pipe: one rank's result can land on the line of
    another's (as seen with rank 0's JSON followed at once by another rank's mark)."""
    stdout = (
        f"a warning\n{RESULT_MARK}"
        '[{"rank": 0, "step_s": [1.5]}]'
        f"{RESULT_MARK}null\nprogress 3/3\n{RESULT_MARK}"
        '{"b": [2, "x"]}\n'
    )
    assert marked_results(stdout) == [[{"rank": 0, "step_s": [1.5]}], None, {"b": [2, "x"]}]
    assert marked_results("no result here\n") == []
