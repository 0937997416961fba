"""Static GPU checks of the Triton kernels, without a GPU.

The kernels are compiled ahead of time for sm_80 and sm_90 with the specialisation the JIT
gives an aligned parameter, and the PTX is checked: every bulk load and store is 128 bits
wide and nothing lives in local memory (no register spills), with round to nearest and with
stochastic rounding of bf16 and fp16 parameters. Compilation runs in a subprocess without
TRITON_INTERPRET, which the interpreter tests set in this process.
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
from lomo_kernels.ops.lomo import triton_backend as m
from lomo_kernels.ops.lomo.spec import GRAD_ACCUMULATE, GRAD_SUMSQ, LOMO_UPDATE
from lomo_kernels.kernels.triton import lomo_kernels as k

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
# (param, grad, stochastic rounding): SR for both low-precision parameter types.
UPDATES = [(bf16, bf16, False), (fp16, fp16, False), (fp32, fp32, False), (bf16, fp32, False),
           (bf16, bf16, True), (fp16, fp16, True), (fp16, fp32, True)]
SUMSQ = [bf16, fp16, fp32]
# (buffer, grad, stochastic rounding, first): the buffer is not read on the first micro-batch.
ACCUMULATES = [(bf16, bf16, False, False), (bf16, bf16, True, False), (bf16, fp32, True, False),
               (fp16, fp16, True, False), (fp32, fp32, False, False), (bf16, bf16, False, True)]
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def sass_local_bytes(cubin, tmp):
    # Local memory of the final machine code (ptxas spills), when the tool is available.
    if not os.path.exists(CUOBJDUMP):
        return None
    with open(tmp, "wb") as f:
        f.write(cubin)
    out = subprocess.run([CUOBJDUMP, "-res-usage", tmp], capture_output=True, text=True).stdout
    found = re.findall(r"LOCAL:(\d+)", out)
    return max(int(x) for x in found) if found else None


def compile_one(fn, signature, constexprs, attrs, arch):
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                    attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": m.NUM_WARPS})
    ptx = k.asm["ptx"]
    return {
        "ld_v4": len(re.findall(r"\bld\.global(?:\.[\w:]+)*\.v4\.", ptx)),
        "st_v4": len(re.findall(r"\bst\.global(?:\.[\w:]+)*\.v4\.", ptx)),
        "local": len(re.findall(r"\.local\b", ptx)),
        "sass_local": sass_local_bytes(k.asm["cubin"], sys.argv[1]),
        "n_bulk_divisible": attrs.get((fn.arg_names.index("n_bulk"),)) == [["tt.divisibility", 16]],
    }


records = []
for arch in (80, 90):
    for param, grad, sr in UPDATES:
        rec = compile_one(*m.aot_update(param, grad, stochastic_rounding=sr), arch)
        rec.update(kernel="update", param=str(param), grad=str(grad), sr=sr, arch=arch)
        records.append(rec)
    for grad in SUMSQ:
        rec = compile_one(*m.aot_grad_sumsq(grad), arch)
        rec.update(kernel="sumsq", param=None, grad=str(grad), sr=False, arch=arch)
        records.append(rec)
    for buffer, grad, sr, first in ACCUMULATES:
        rec = compile_one(*m.aot_grad_accumulate(buffer, grad, first=first,
                                                 stochastic_rounding=sr), arch)
        rec.update(kernel="accumulate" + ("-first" if first else ""), param=str(buffer),
                   grad=str(grad), sr=sr, arch=arch)
        records.append(rec)

# The AOT specialisation must be the one the JIT computes for the same launch.
mismatches = []
try:
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
except ImportError:
    native_specialize_impl = None
if native_specialize_impl is not None:
    for kernel, (_, args) in [
        # (param, grad, lr, inv_scale, clip_value, clip_coef, weight_decay, found_inf,
        #  skip_if, stochastic_rounding, seed, seed_step)
        (k.lomo_update_kernel, m.lomo_update_args(LOMO_UPDATE.Arguments(
            torch.empty(2 * m.BLOCK + 5, dtype=bf16), torch.empty(2 * m.BLOCK + 5),
            torch.full((1,), 0.1), None, None, None, 0.0, torch.zeros(1), None, True, 7,
            torch.zeros(1, dtype=torch.int64)))),
        (k.lomo_update_kernel, m.lomo_update_args(LOMO_UPDATE.Arguments(
            torch.empty(2 * m.BLOCK + 5, dtype=fp16), torch.empty(2 * m.BLOCK + 5, dtype=fp16),
            torch.full((1,), 0.1), None, None, None, 0.0, None, None, True, 2**63 + 17, None))),
        # (grad, inv_scale, sumsq, found_inf)
        (k.grad_sumsq_kernel, m.grad_sumsq_args(GRAD_SUMSQ.Arguments(
            torch.empty(4 * m.BLOCK + 1, dtype=fp16), torch.full((1,), 0.5), torch.zeros(1),
            None))),
        # (buffer, grad, first, inv_scale, sumsq, found_inf, stochastic_rounding, seed,
        #  seed_step)
        (k.grad_accumulate_kernel, m.grad_accumulate_args(GRAD_ACCUMULATE.Arguments(
            torch.empty(2 * m.BLOCK + 5, dtype=bf16), torch.empty(2 * m.BLOCK + 5), False,
            torch.full((1,), 0.5), torch.zeros(1), None, True, 7,
            torch.zeros(1, dtype=torch.int64)))),
    ]:
        signature, constexprs, attrs = m.aot_signature(kernel, args)
        for i, p in enumerate(kernel.params):
            if p.is_constexpr:
                continue
            ty, spec = native_specialize_impl(BaseBackend, args[p.name], False,
                                              not p.do_not_specialize, True)
            mine = (signature[p.name], (i,) in attrs and attrs[(i,)] != [])
            jit = (ty, spec == "D")
            if ty == "constexpr":
                mine, jit = (signature[p.name], constexprs.get(p.name)), (ty, spec)
            if mine != jit:
                mismatches.append(f"{kernel.__name__}.{p.name}: aot {mine} jit {jit}")

runtime_constexprs = {
    kernel.__name__: sorted(p.name for p in kernel.params if p.is_constexpr)
    for kernel in (k.lomo_update_kernel, k.grad_sumsq_kernel, k.grad_accumulate_kernel)
}
print(json.dumps({"records": records, "mismatches": mismatches,
                  "checked_spec": native_specialize_impl is not None,
                  "constexprs": runtime_constexprs,
                  "elems_per_thread": m.BLOCK // (32 * m.NUM_WARPS)}))
"""

_ITEMSIZE = {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cubin = tmp_path_factory.mktemp("aot") / "kernel.cubin"
    return run_compile_script(_COMPILE_SCRIPT, str(cubin))


def _record_ids(compiled: dict) -> list[str]:
    return [
        f"{r['kernel']}-{r['param']}-{r['grad']}-sr{r['sr']}-sm{r['arch']}"
        for r in compiled["records"]
    ]


def test_every_variant_compiled_for_both_architectures(compiled: dict) -> None:
    ids = _record_ids(compiled)
    assert len(ids) == len(set(ids)) == 32
    assert {r["arch"] for r in compiled["records"]} == {80, 90}


def test_bulk_bound_and_pointers_are_specialised_divisible(compiled: dict) -> None:
    assert all(r["n_bulk_divisible"] for r in compiled["records"])


def test_bulk_loads_and_stores_are_128_bit(compiled: dict) -> None:
    per_thread = compiled["elems_per_thread"]
    for rec, name in zip(compiled["records"], _record_ids(compiled), strict=True):
        grad_bytes = per_thread * _ITEMSIZE[rec["grad"]]
        if rec["kernel"] == "update":
            param_bytes = per_thread * _ITEMSIZE[rec["param"]]
            # Every bulk byte of grad and param moves in 16-byte vectors.
            assert rec["ld_v4"] == (grad_bytes + param_bytes) // 16, name
            assert rec["st_v4"] == param_bytes // 16, name
        elif rec["kernel"].startswith("accumulate"):
            buffer_bytes = per_thread * _ITEMSIZE[rec["param"]]
            # The first micro-batch's pass reads the gradient only.
            read = grad_bytes + (0 if rec["kernel"].endswith("first") else buffer_bytes)
            assert rec["ld_v4"] == read // 16, name
            assert rec["st_v4"] == buffer_bytes // 16, name
        else:
            assert rec["ld_v4"] == grad_bytes // 16, name
            assert rec["st_v4"] == 0, name


def test_no_local_memory(compiled: dict) -> None:
    for rec, name in zip(compiled["records"], _record_ids(compiled), strict=True):
        assert rec["local"] == 0, name
        assert rec["sass_local"] in (None, 0), name


def test_aot_specialisation_matches_jit(compiled: dict) -> None:
    if not compiled["checked_spec"]:
        pytest.skip("this triton has no native_specialize_impl to compare with")
    assert compiled["mismatches"] == []


def test_runtime_values_are_not_constexpr(compiled: dict) -> None:
    assert compiled["constexprs"] == {
        "lomo_update_kernel": sorted(
            ["PARAM_KIND", "GRAD_KIND", "HAS_CLIP_VALUE", "STOCHASTIC_ROUNDING", "BLOCK"]
        ),
        "grad_sumsq_kernel": sorted(["GRAD_KIND", "BLOCK"]),
        "grad_accumulate_kernel": sorted(
            ["FIRST", "BUFFER_KIND", "GRAD_KIND", "STOCHASTIC_ROUNDING", "BLOCK"]
        ),
    }
