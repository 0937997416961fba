"""Timing variants against each other in one process (method: MEASURING.md).

`time_interleaved` times the variants in turn within each repetition (A, B, C, A, B, C,
...), so a burst of load on a shared machine slows them alike, and gives each one's median
(or another statistic) over the repetitions. A clock times one call:

  WallClock   perf_counter around the call, after synchronizing a CUDA device (the default)
  ThreadClock the calling thread's CPU time (a preempted call does not count the other jobs'
              time; memory stalls are CPU time, so memory-bound work is measured fully)
  DeviceClock on CUDA the device's time of the call's kernels (launch overhead hidden), on
              CPU the wall clock; the host's enqueue time is kept apart
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .torch_internals import cuda_spin

FLUSH_BYTES = 256 * 2**20
# The spin kernel that hides launch overhead from CUDA device timings (DeviceClock.time).
# Cycles per second is a round figure for current GPU clocks (1.4-2 GHz): only the margin
# depends on it.
MIN_SPIN_CYCLES = 200_000
SPIN_CYCLES_PER_S = 2e9
SPIN_RETRIES = 6


def synchronize(device: str | torch.device) -> None:
    """Waits for a CUDA device's queued work (a host clock read would time the launches only)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class WallClock:
    """Wall time of a call, bracketed by synchronizations of a CUDA `device`."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = device
        self.last_host_s = 0.0

    def time(self, fn: Callable[[], object]) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        fn()
        synchronize(self.device)
        self.last_host_s = time.perf_counter() - start
        return self.last_host_s


class ThreadClock:
    """The calling thread's CPU time of a call (CLOCK_THREAD_CPUTIME_ID): CPU figures only."""

    last_host_s = 0.0

    def time(self, fn: Callable[[], object]) -> float:
        start = time.thread_time_ns()
        fn()
        self.last_host_s = (time.thread_time_ns() - start) * 1e-9
        return self.last_host_s


class DeviceClock:
    """Wall time on CPU. On CUDA, device time: the GPU is kept busy (a spin kernel) while the
    host enqueues the timed call, so the events bracket the kernels alone, not the launch
    overhead; the host's enqueue time of the same call is kept apart in `last_host_s`."""

    def __init__(self, device: str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._flush = (
            torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None
        )
        self.last_host_s = 0.0
        self.unisolated = 0  # CUDA calls whose device time includes host time

    def settle(self, tensors: Sequence[torch.Tensor]) -> None:
        """The same cache state before every call: on CUDA the L2 overwritten, on CPU every
        one of `tensors` read once."""
        if self.cuda:
            self._flush.zero_()  # evict the case's data from L2
            torch.cuda.synchronize()
        else:
            read_once(tensors)

    def time(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            self.last_host_s = time.perf_counter() - start
            return self.last_host_s
        # Spin three times the last host enqueue time (of any call), doubled while too short.
        spin = max(MIN_SPIN_CYCLES, int(3 * self.last_host_s * SPIN_CYCLES_PER_S))
        for _ in range(SPIN_RETRIES):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            cuda_spin(spin)
            start.record()
            t0 = time.perf_counter()
            fn()
            self.last_host_s = time.perf_counter() - t0
            end.record()
            # The spin ended before the host had enqueued everything: the GPU waited on the
            # host inside the timed region. Spin longer and time again.
            starved = start.query()
            end.synchronize()
            if not starved:
                return start.elapsed_time(end) / 1e3
            spin *= 2
        # A call that synchronizes with the host: its time includes the host's; counted and
        # reported with the table rather than lost.
        self.unisolated += 1
        return start.elapsed_time(end) / 1e3


Clock = WallClock | ThreadClock | DeviceClock

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def read_once(tensors: Sequence[torch.Tensor]) -> None:
    """Reads every element of `tensors` (as integers: no float work), untimed."""
    for t in tensors:
        t.view(_INT_VIEW[t.element_size()]).max()


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    reps: int,
    clock: Clock | None = None,
    settle: Callable[[str], None] | None = None,
    warmup: int = 2,
    host: dict[str, float] | None = None,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
    """Seconds per variant (`statistic` of its repetitions, the median by default), the
    variants timed in turn within each repetition after `warmup` untimed rounds.

    `settle(name)` runs, untimed, before every timed call, so every variant starts from the
    same state (variants that allocate large temporaries would otherwise slow the next one).
    `host`, if given, receives the median host (enqueue) seconds per variant.
    """
    clock = clock or WallClock()
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    host_times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if settle is not None:
                settle(name)
            times[name].append(clock.time(fn))
            host_times[name].append(clock.last_host_s)
    if host is not None:
        host.update({name: statistics.median(ts) for name, ts in host_times.items()})
    return {name: statistic(ts) for name, ts in times.items()}
