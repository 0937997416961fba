"""Peak memory readings: the process's (CPU) or the caching allocator's (CUDA), and the
tensors' own (the profiler's allocator events). Method: MEASURING.md.

CPU: glibc returns freed memory to the system only for mmapped blocks, so a metered process
starts with MALLOC_MMAP_THRESHOLD_=65536 (`process.run_isolated(..., metered=True)`): every
block >= 64 KiB is mmapped and leaves the RSS when freed. The baseline is VmRSS; writing "5"
to /proc/self/clear_refs resets VmHWM (the peak RSS) to the current RSS, and VmHWM read after
a step is its peak. CUDA: `memory_allocated()` as the baseline, `max_memory_allocated()`
after `reset_peak_memory_stats()`. MiB = 2**20 bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_VALUE = "65536"
MIB = 2**20


def require_metered_process() -> None:
    """Refuses to meter a CPU process started without the malloc setting (its VmHWM would
    keep freed blocks)."""
    if os.environ.get(MMAP_ENV) != MMAP_VALUE:
        raise RuntimeError(f"{MMAP_ENV}={MMAP_VALUE} must be set before the process starts")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def hwm_bytes() -> int:
    return _status_kb("VmHWM") * 1024


def reset_hwm() -> None:
    # "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Meter:
    """Baseline and per-step peak in bytes: /proc on CPU, the allocator on CUDA."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.cuda = device.startswith("cuda")
        # The statistics of `device` itself (cuda:N), not of the current device.
        self.device = device

    def current(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            return self.torch.cuda.memory_allocated(self.device)
        return rss_bytes()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_hwm()

    def peak(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            return self.torch.cuda.max_memory_allocated(self.device)
        return hwm_bytes()


def tensor_balance(run: Callable[[], None], device: str) -> tuple[int, int]:
    """(peak, end) in bytes of the tensors allocated while `run` runs, above what was
    allocated when it started: every allocation and free on `device` as the profiler's
    allocator events record them, those of compiled code included.

    The analogue on CPU of the CUDA allocator's peak statistics: tensor memory only, not
    the rest of the process (code, Python objects), which VmHWM also counts. `end` is what
    `run` left allocated (lazy state, constants a compiler keeps).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, profile_memory=True) as prof:
        run()
        if cuda:
            torch.cuda.synchronize(device)
    events = sorted(
        (
            e
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == kind
        ),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak, current
