"""The bound launch of compiled Triton kernels (kernels/triton/bound_launch.py), without a GPU.

It must launch exactly what the JIT would: its key must be at least as fine as Triton's own
specialisation of every argument (else a cached kernel compiled for another specialisation
could run), and it must call ``CompiledKernel.run`` as Triton's own launch does. The first is
checked against Triton's ``native_specialize_impl`` on every kind of argument the kernels
take; the second against ``CompiledKernel.__getitem__``'s runner on a kernel compiled ahead
of time for sm_90, its driver calls replaced by recorders. The time a launch saves is a GPU
figure (``python -m bench.host_time --device cuda``).
"""

from __future__ import annotations

import pytest
import torch
from support.aot import run_compile_script
from support.dependencies import require

from lomo_kernels.kernels.triton.bound_launch import BoundKernels, runtime_key

triton = require("triton")

_SCRIPT = r"""
import json, itertools
import torch, triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.runtime.jit import native_specialize_impl
from lomo_kernels.kernels.triton.bound_launch import BoundKernels, runtime_key
from lomo_kernels.kernels.triton import lomo_kernels as k
from lomo_kernels.ops.lomo import triton_backend as m
from lomo_kernels.ops.lomo.spec import LOMO_UPDATE

# Every kind of value a runtime argument of the kernels takes, and the edges of Triton's
# integer and alignment specialisation.
base = torch.zeros(64)
VALUES = [
    base, base[1:], base[4:], torch.zeros(8, dtype=torch.bfloat16).view(torch.int16),
    torch.zeros(8, dtype=torch.float16), torch.zeros(2, dtype=torch.int64), None,
    0, 1, 2, 15, 16, 17, 32, -16, -1, 2**31 - 16, 2**31, 2**31 + 1, 2**63 - 16, 2**63, 2**64 - 16,
    0.0, 1.0, 0.5, True, False,
]
conflicts = []
for kernel in (k.lomo_update_kernel, k.grad_sumsq_kernel, k.grad_accumulate_kernel):
    for p in kernel.params:
        if p.is_constexpr:
            continue
        seen = {}
        for v in VALUES:
            ours = runtime_key(v)
            theirs = native_specialize_impl(BaseBackend, v, False, not p.do_not_specialize,
                                            not p.do_not_specialize_on_alignment)
            if seen.setdefault(ours, theirs) != theirs:
                conflicts.append(f"{kernel.__name__}.{p.name}: {v!r} {ours} -> "
                                 f"{theirs} and {seen[ours]}")

# The launch call: BoundKernels against Triton's own runner, on a kernel compiled ahead of
# time, driver calls recorded.
kernel, signature, constexprs, attrs = m.aot_update(torch.bfloat16, torch.bfloat16,
                                                    stochastic_rounding=True)
compiled = triton.compile(
    triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                              attrs=attrs),
    target=GPUTarget("cuda", 90, 32), options={"num_warps": m.NUM_WARPS})
n = 2 * m.BLOCK + 5
grid, arguments = m.lomo_update_args(LOMO_UPDATE.Arguments(
    torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16),
    torch.full((1,), 1e-3), torch.ones(1), 1.0, torch.ones(1), 0.01, torch.zeros(1),
    torch.zeros(1), True, 7, torch.zeros(1, dtype=torch.int64), 0))
calls = []
compiled._run = lambda *args: calls.append(args)
compiled.module, compiled.function = "module", 4242  # as loaded on the device
bound = BoundKernels(kernel.params, m.NUM_WARPS)
values = [arguments[name] for name in bound.arg_names]
bound.compiled[bound.key(values, 0)] = compiled
bound._stream = lambda device: 9000 + device
bound.launch(None, grid, arguments, 0)  # cached: the JIT (None here) is never touched
compiled[(*grid, 1, 1)](*values, stream=9000)  # Triton's own runner

def same(a, b):
    return len(a) == len(b) and all(x is y or (type(x) is not torch.Tensor and x == y)
                                    for x, y in zip(a, b))

ours, tritons = calls if len(calls) == 2 else ((), ())
print(json.dumps({
    "conflicts": conflicts,
    "calls": len(calls),
    # Triton passes its (empty) hook chains and their metadata; without hooks we pass None,
    # which the launcher skips as it does an empty chain.
    "same_call": same(ours[:6], tritons[:6]) and same(ours[9:], tritons[9:]),
    "our_hooks": list(ours[6:9]),
    "tritons_hooks_empty": [getattr(h, "calls", None) for h in tritons[7:9]] == [[], []],
    "head": [c for c in calls[0][:9] if not isinstance(c, (bytes, tuple))] if calls else [],
    "all_parameters": len(calls[0]) - 9 == len(kernel.params) if calls else False,
}))
"""


@pytest.fixture(scope="module")
def aot() -> dict:
    return run_compile_script(_SCRIPT)


def test_key_is_at_least_as_fine_as_tritons_specialisation(aot):
    """Two values with one key never get different specialisations from Triton."""
    assert aot["conflicts"] == []


def test_launch_calls_the_compiled_kernel_as_tritons_runner_does(aot):
    assert aot["calls"] == 2 and aot["same_call"]
    assert aot["our_hooks"] == [None, None, None] and aot["tritons_hooks_empty"]
    assert aot["head"][:5] == [aot["head"][0], 1, 1, 9000, 4242]
    assert aot["all_parameters"]  # every parameter, constexprs included, in order


class Param:
    def __init__(self, name: str, is_constexpr: bool = False) -> None:
        self.name, self.is_constexpr = name, is_constexpr


class FakeJit:
    """A JIT function's launch, recorded; returns a compiled kernel whose runs are recorded."""

    def __init__(self) -> None:
        self.launches: list[dict] = []
        self.runs: list[tuple] = []

    def __getitem__(self, grid):
        def launch(**arguments):
            self.launches.append(arguments)
            jit = self

            class Compiled:
                function, packed_metadata = "function", "metadata"

                @staticmethod
                def run(*args):
                    jit.runs.append(args)

            return Compiled()

        return launch


def bound_kernels() -> tuple[BoundKernels, FakeJit]:
    bound = BoundKernels([Param("x_ptr"), Param("n"), Param("BLOCK", True)], num_warps=4)
    bound._stream = lambda device: 100 + device
    return bound, FakeJit()


def test_first_launch_of_a_specialisation_goes_through_the_jit_then_runs_bound():
    bound, jit = bound_kernels()
    x = torch.zeros(64)
    arguments = {"x_ptr": x, "n": 64, "BLOCK": 128}
    bound.launch(jit, (3,), arguments, 0)
    bound.launch(jit, (3,), {**arguments, "n": 48}, 0)  # 48: divisible by 16 as 64 is
    assert len(jit.launches) == 1
    assert jit.runs == [(3, 1, 1, 100, "function", "metadata", None, None, None, x, 48, 128)]


@pytest.mark.parametrize(
    "change",
    [
        {"n": 65},  # not divisible by 16
        {"n": 1},  # Triton makes a 1 a constant
        {"n": 2**31},  # i64
        {"BLOCK": 256},  # another constexpr value
        {"x_ptr": torch.zeros(64)[1:]},  # misaligned
        {"x_ptr": torch.zeros(64, dtype=torch.float16)},  # another dtype
        {"x_ptr": None},
    ],
    ids=["n-odd", "n-one", "n-i64", "constexpr", "misaligned", "dtype", "none"],
)
def test_another_specialisation_goes_through_the_jit(change):
    bound, jit = bound_kernels()
    arguments = {"x_ptr": torch.zeros(64), "n": 64, "BLOCK": 128}
    bound.launch(jit, (1,), arguments, 0)
    bound.launch(jit, (1,), {**arguments, **change}, 0)
    assert len(jit.launches) == 2 and jit.runs == []


def test_other_device_unknown_values_and_launch_hooks_go_through_the_jit(monkeypatch):
    bound, jit = bound_kernels()
    arguments = {"x_ptr": torch.zeros(64), "n": 64, "BLOCK": 128}
    bound.launch(jit, (1,), arguments, 0)
    bound.launch(jit, (1,), arguments, 1)  # compiled kernels are per device
    bound.launch(jit, (1,), {**arguments, "n": 64.0 + 0j}, 0)  # no key: always the JIT
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    bound.launch(jit, (1,), arguments, 0)  # a profiler reads every launch
    assert len(jit.launches) == 4 and jit.runs == []


def test_a_launcher_leaving_a_parameter_to_its_default_always_uses_the_jit():
    bound, jit = bound_kernels()
    for _ in range(2):
        bound.launch(jit, (1,), {"x_ptr": torch.zeros(64), "n": 64}, 0)
    assert len(jit.launches) == 2 and jit.runs == []


def test_a_launcher_refusing_the_arguments_turns_to_the_jit_for_good():
    """A triton whose compiled-kernel launcher takes other arguments refuses them before
    launching (a TypeError): that launch and every later one go through the JIT."""
    bound, jit = bound_kernels()
    arguments = {"x_ptr": torch.zeros(64), "n": 64, "BLOCK": 128}
    bound.launch(jit, (1,), arguments, 0)
    key = next(iter(bound.compiled))

    class Refusing:
        function, packed_metadata = "function", "metadata"

        @staticmethod
        def run(*args):
            raise TypeError("function takes exactly 14 arguments (12 given)")

    bound.compiled[key] = Refusing()
    with pytest.warns(RuntimeWarning, match="refused the direct launch"):
        bound.launch(jit, (1,), arguments, 0)
    bound.launch(jit, (1,), arguments, 0)
    assert len(jit.launches) == 3 and jit.runs == []


def test_runtime_key_refuses_what_it_cannot_classify():
    with pytest.raises(TypeError):
        runtime_key(object())
