"""The AdaLomo Triton kernels compile for a GPU, without one.

Under the interpreter (the other AdaLomo tests) a kernel runs as Python: what only the
compiler sees (types, constexpr branches, the GPU tiling's block shapes) is checked here.
Every launch the launchers make, with the sizes they choose on a GPU (`adalomo._tiling`'s CUDA
branch, 132 SMs as an H100's), is compiled ahead of time for sm_90 with the specialisation the
JIT gives it; nothing lives in local memory (the PTX's, or ptxas spills in the machine code
when cuobjdump is at hand). The write-back passes are compiled with
stochastic rounding too (bf16 and fp16 parameters, with and without the per-step seed), and
keep the vector widths of their round-to-nearest variants. Compilation runs in a subprocess
without TRITON_INTERPRET, which the interpreter tests set in this process.
"""

from __future__ import annotations

import pytest
from support.aot import run_compile_script
from support.dependencies import require

require("triton")

# Runs in the subprocess; prints one JSON object.
_COMPILE_SCRIPT = r"""
import json, os, re, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from lomo_kernels.ops.adalomo import triton_backend as a
from lomo_kernels.kernels.triton import adalomo_kernels as k
from lomo_kernels.ops.lomo.triton_backend import aot_signature
from lomo_kernels.ops.adalomo.workspace import workspace_numel

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
        a.factored_stats_(g, p, ws, fi, sk, 4097, inv, cv, 0)
        a.factored_moments_(r, c, ws, scalar(0.9), cc, 1e-30)
        a.factored_norm_(g, r, c, ws, inv, cv, cc, 0)
        # The per-step seed with the other optional inputs; fp32 ignores stochastic rounding.
        step = torch.zeros(1, dtype=torch.int64) if every_option else None
        v, p1, g1, ws1 = torch.zeros(p.numel()), p.view(-1), g.view(-1), torch.zeros(5)
        a.vector_stats_(g1, p1, v, ws1, fi, sk, scalar(0.9), 1e-30, inv, cv, cc)
        for sr in (False, True):
            a.factored_apply_(p, g, r, c, ws, scalar(0.1), 1e-3, 1.0, 0.1, inv, cv, cc, sr,
                              2**63 + 17, step, 0)
            a.vector_apply_(p1, g1, v, ws1, scalar(0.9), 1e-30, scalar(0.1), 1e-3, 1.0, 0.1, inv,
                            cv, cc, sr, 2**63 + 17, step, 0, p1.numel())

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def sass_local_bytes(cubin):
    # Local memory of the final machine code (ptxas spills), when the tool is available.
    if not os.path.exists(CUOBJDUMP):
        return None
    with open(sys.argv[1], "wb") as f:
        f.write(cubin)
    out = subprocess.run([CUOBJDUMP, "-res-usage", sys.argv[1]], capture_output=True,
                         text=True).stdout
    found = re.findall(r"LOCAL:(\d+)", out)
    return max(int(x) for x in found) if found else None


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
    ptx = compiled.asm["ptx"]
    records.append({
        "kernel": kernel.__name__,
        "local": ".local" in ptx,
        "sass_local": sass_local_bytes(compiled.asm["cubin"]),
        "dtype": constexprs.get("PARAM_KIND"),
        "options": "inv_scale_ptr" not in constexprs,  # given: not a None constant
        "sr": bool(constexprs.get("STOCHASTIC_ROUNDING", False)),
        "ld_v4": len(re.findall(r"\bld\.global(?:\.[\w:]+)*\.v4\.", ptx)),
        "st_v4": len(re.findall(r"\bst\.global(?:\.[\w:]+)*\.v4\.", ptx)),
    })
print(json.dumps(records))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list:
    cubin = tmp_path_factory.mktemp("aot") / "kernel.cubin"
    return run_compile_script(_COMPILE_SCRIPT, str(cubin))


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
    # Per dtype, with and without the optional inputs (moments: with and without clip_coef),
    # and the two write-back passes with stochastic rounding for bf16 and fp16.
    assert len(compiled) == 3 * 2 * 5 + 2 + 2 * 2 * 2


def test_stochastic_rounding_variants(compiled: list) -> None:
    """Only the write-back passes of bf16 (2) and fp16 (1) parameters round stochastically,
    with and without the optional inputs (the per-step seed among them)."""
    variants = {(r["kernel"], r["dtype"], r["options"]) for r in compiled if r["sr"]}
    assert variants == {
        (kernel, kind, options)
        for kernel in ("factored_apply_kernel", "vector_apply_kernel")
        for kind in (1, 2)
        for options in (False, True)
    }


def test_stochastic_rounding_keeps_the_vector_widths(compiled: list) -> None:
    """The rounding adds arithmetic, not memory traffic: each stochastic variant moves its
    data in as many 128-bit loads and stores as its round-to-nearest twin (the 1-D pass
    has some: its numel, a multiple of 16, is specialised divisible)."""
    nearest = {(r["kernel"], r["dtype"], r["options"]): r for r in compiled if not r["sr"]}
    for r in (r for r in compiled if r["sr"]):
        twin = nearest[(r["kernel"], r["dtype"], r["options"])]
        assert (r["ld_v4"], r["st_v4"]) == (twin["ld_v4"], twin["st_v4"]), r
        if r["kernel"] == "vector_apply_kernel":
            assert r["ld_v4"] > 0 and r["st_v4"] > 0, r


def test_no_local_memory(compiled: list) -> None:
    assert [r["kernel"] for r in compiled if r["local"]] == []
    assert [r for r in compiled if r["sass_local"] not in (None, 0)] == []
