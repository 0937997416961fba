"""The AdaLomo Triton kernels compile for a GPU, without one.

Under the interpreter (the other AdaLomo tests) a kernel runs as Python: what only the
compiler sees (types, constexpr branches, the GPU tiling's block shapes) is checked here.
Every launch the launchers make, with the sizes they choose on a GPU (`adalomo._tiling`'s CUDA
branch, 132 SMs as an H100's), is compiled ahead of time for sm_90 with the specialisation the
JIT gives it; the PTX keeps nothing in local memory. Compilation runs in a subprocess without
TRITON_INTERPRET, which the interpreter tests set in this process.
"""

from __future__ import annotations

import pytest
from aot import run_compile_script
from dependencies import require

require("triton")

# Runs in the subprocess; prints one JSON object.
_COMPILE_SCRIPT = r"""
import json
import torch, triton
from triton.backends.compiler import GPUTarget
from lomo_kernels.kernels.triton import adalomo as a
from lomo_kernels.kernels.triton import adalomo_kernels as k
from lomo_kernels.kernels.triton.lomo import aot_signature
from lomo_kernels.ops.adalomo_workspace import workspace_numel

launches = []


class Recorded:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, num_warps, **kwargs):
            bound = dict(zip(self.kernel.arg_names, args), **kwargs)
            launches.append((self.kernel, bound, num_warps))
        return launch


class Kernels:
    def __getattr__(self, name):
        return Recorded(getattr(k, name))


a._kernels = Kernels
a._sm_count = lambda index: 132
tiling = a._tiling
a._tiling = lambda rows, cols, device: tiling(rows, cols, torch.device("cuda", 0))


def scalar(v):
    return torch.full((1,), v)


for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for every_option in (False, True):
        p, g = torch.zeros(64, 4097, dtype=dtype), torch.zeros(64, 4097, dtype=dtype)
        ws, r, c = torch.zeros(workspace_numel(p.shape)), torch.zeros(64), torch.zeros(4097)
        inv, cv, cc = (scalar(0.5), 1.0, scalar(0.3)) if every_option else (None, None, None)
        fi, sk = (torch.zeros(1), torch.zeros(1)) if every_option else (None, None)
        a.factored_stats_(g, p, ws, fi, sk, 4097, inv, cv)
        a.factored_moments_(r, c, ws, scalar(0.9), cc, 1e-30)
        a.factored_norm_(g, r, c, ws, inv, cv, cc)
        a.factored_apply_(p, g, r, c, ws, scalar(0.1), 1e-3, 1.0, 0.1, inv, cv, cc)
        v, p1, g1, ws1 = torch.zeros(p.numel()), p.view(-1), g.view(-1), torch.zeros(5)
        a.vector_stats_(g1, p1, v, ws1, fi, sk, scalar(0.9), 1e-30, inv, cv, cc)
        a.vector_apply_(p1, g1, v, ws1, scalar(0.9), 1e-30, scalar(0.1), 1e-3, 1.0, 0.1, inv,
                        cv, cc)

records, seen = [], set()
for kernel, args, num_warps in launches:
    signature, constexprs, attrs = aot_signature(kernel, args)
    key = (kernel.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items())))
    if key in seen:
        continue
    seen.add(key)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})
    records.append({"kernel": kernel.__name__, "local": ".local" in compiled.asm["ptx"]})
print(json.dumps(records))
"""


@pytest.fixture(scope="module")
def compiled() -> list:
    return run_compile_script(_COMPILE_SCRIPT)


def test_every_pass_compiles_for_sm90_with_the_gpu_tiling(compiled: list) -> None:
    kernels = {r["kernel"] for r in compiled}
    assert kernels == {
        "factored_stats_kernel",
        "factored_moments_kernel",
        "factored_norm_kernel",
        "factored_apply_kernel",
        "vector_stats_kernel",
        "vector_apply_kernel",
    }
    # Per dtype, with and without the optional inputs (moments: with and without clip_coef).
    assert len(compiled) == 3 * 2 * 5 + 2


def test_no_local_memory(compiled: list) -> None:
    assert [r["kernel"] for r in compiled if r["local"]] == []
