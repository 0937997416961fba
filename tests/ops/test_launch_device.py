"""Work on a CUDA device that is not the current one (a model on cuda:1, `--device cuda:1`),
and copies between a GPU and the CPU (a model partly on each).

Triton launches on the current device and its stream, so every Triton launcher makes its
tensors' device current first (`runtime.on_device_of`), as the CUDA C++ bindings' device
guard does. Checked here without a GPU: the device logic on a stand-in for a tensor on
cuda:1 (CUDA's device functions replaced by recorders), and that every Triton launcher runs
under it; the benchmarks' memory meter reads and synchronises the device it was given; the
optimizers' copies of their scalars onto the CPU are synchronous (an asynchronous one lands in
pinned memory the host could read before it is written), onto a GPU asynchronous.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from bench.common.meter import Meter
from lomo_kernels.core.scalars import copied_to
from lomo_kernels.kernels.triton import runtime
from lomo_kernels.ops import backends
from lomo_kernels.ops.adalomo import SPECS as ADALOMO_SPECS
from lomo_kernels.ops.cross_entropy import triton_backend as linear_cross_entropy
from lomo_kernels.ops.lomo.spec import SPECS as LOMO_SPECS


class _OnCuda:
    """What `on_device_of` reads of a CUDA tensor on device `index`."""

    is_cuda = True

    def __init__(self, index: int) -> None:
        self.index = index
        self.device = torch.device("cuda", index)

    def get_device(self) -> int:
        return self.index


@pytest.fixture
def made_current(monkeypatch) -> list[torch.device]:
    """CUDA's current device is 0; each `torch.cuda.device(d)` entered is recorded."""
    entered: list[torch.device] = []

    @contextlib.contextmanager
    def device(d: torch.device):
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)
    return entered


def test_a_tensor_on_another_cuda_device_is_launched_on_its_own(made_current) -> None:
    with runtime.on_device_of(_OnCuda(1)):
        pass
    assert made_current == [torch.device("cuda", 1)]


def test_a_tensor_on_the_current_device_or_the_cpu_changes_nothing(made_current) -> None:
    for tensor in (_OnCuda(0), torch.zeros(1)):
        with runtime.on_device_of(tensor):
            pass
    assert made_current == []


def _launchers() -> list:
    """Every op's Triton launcher (from the specs: an op added there is checked here) and the
    fused cross-entropy's."""
    lomo = backends.LOMO.importers["triton"]()
    adalomo = backends.ADALOMO.importers["triton"]()
    return [
        *(getattr(lomo, spec.function) for spec in LOMO_SPECS),
        *(getattr(adalomo, spec.function) for spec in ADALOMO_SPECS),
        linear_cross_entropy.forward,
        linear_cross_entropy.backward_chunk,
    ]


class _Entered(Exception):
    """Raised on entering a launch's device context: nothing of the launch runs before."""


class _StopOnEnter(contextlib.AbstractContextManager):
    def __enter__(self) -> None:
        raise _Entered

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("launcher", _launchers(), ids=lambda f: f.__name__)
def test_every_triton_launcher_runs_on_its_first_tensor_device(launcher, monkeypatch) -> None:
    """Each launcher enters `on_device_of` its first tensor before anything else: the
    context stops it on entry, so neither a kernel nor a check of the other arguments runs
    outside it (those left out here would fail any launcher that read them first)."""
    entered: list[torch.Tensor] = []

    def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
        entered.append(t)
        return _StopOnEnter()

    monkeypatch.setattr(runtime, "on_device_of", on_device_of)
    first = torch.zeros(3)
    with pytest.raises(_Entered):
        launcher(first)
    assert len(entered) == 1 and entered[0] is first


def test_a_launch_is_made_under_its_first_tensor_device(monkeypatch) -> None:
    """A real launch (the interpreter, on CPU) enters `on_device_of` with its parameter."""
    seen: list[torch.Tensor] = []

    def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
        seen.append(t)
        return contextlib.nullcontext()

    monkeypatch.setattr(runtime, "on_device_of", on_device_of)
    param, grad = torch.ones(7), torch.full((7,), 2.0)
    lomo = backends.LOMO.importers["triton"]()
    lomo.lomo_update_(param, grad, torch.full((1,), 0.5), None, None, None, 0.0, None, None,
                      False, 0, None, 0)  # fmt: skip
    assert len(seen) == 1 and seen[0] is param
    assert torch.equal(param, torch.zeros(7))  # 1 - 0.5 * 2, launched


def test_the_memory_meter_reads_the_device_it_measures(monkeypatch) -> None:
    calls: list[tuple[str, object]] = []
    for name in ("synchronize", "memory_allocated", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda d=None, name=name: calls.append((name, d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: calls.append(("max", d)))
    meter = Meter("cuda:1")
    meter.current(), meter.reset_peak(), meter.peak()
    assert calls and all(device == "cuda:1" for _, device in calls), calls


def test_scalars_reach_the_cpu_synchronously_and_a_gpu_asynchronously() -> None:
    class Recorded:
        def to(self, device: torch.device, non_blocking: bool = False) -> tuple:
            return device, non_blocking

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert copied_to(Recorded(), cpu) == (cpu, False)
    assert copied_to(Recorded(), gpu) == (gpu, True)
    value = torch.tensor([2.5])
    assert copied_to(value, cpu) is value  # already there: no copy
