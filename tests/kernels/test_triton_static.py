"""Static GPU checks of the Triton kernels, without a GPU.

The kernels are compiled ahead of time for sm_80 and sm_90 with the specialisation the JIT
gives an aligned parameter, and the PTX is checked: every bulk load and store is 128 bits
wide and nothing lives in local memory (no register spills), with round to nearest and with
stochastic rounding of bf16 and fp16 parameters; the 8-bit blockwise buffer's kernels too
(128-bit where the buffer's block alignment permits). Compilation runs in a subprocess
without TRITON_INTERPRET, which the interpreter tests set in this process.
"""

from __future__ import annotations

import pytest
from support.aot import run_compile_script
from support.dependencies import require

require("triton")

# The compile scripts' shared part: `compile_one` compiles a kernel for an architecture and
# measures its PTX.
_PRELUDE = r"""
import json, os, re, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from lomo_kernels.ops.lomo import triton_backend as m

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
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
        "divisible": [name for i, name in enumerate(fn.arg_names)
                      if attrs.get((i,)) == [["tt.divisibility", 16]]],
    }


try:
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
except ImportError:
    native_specialize_impl = None
CHECKS_SPECIALISATION = native_specialize_impl is not None


def specialisation_mismatches(launches):
    # Where m.aot_signature disagrees with the JIT's own specialisation of a launch's
    # arguments ([] when this triton has no native_specialize_impl to compare with).
    mismatches = []
    for kernel, (_, args) in launches if CHECKS_SPECIALISATION else []:
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
    return mismatches
"""

# Runs in the subprocess after the prelude; prints one JSON object.
_COMPILE_SCRIPT = (
    _PRELUDE
    + r"""
from lomo_kernels.ops.lomo.spec import GRAD_ACCUMULATE, GRAD_SUMSQ, LOMO_UPDATE
from lomo_kernels.kernels.triton import lomo_kernels as k

# (param, grad, stochastic rounding): SR for both low-precision parameter types.
UPDATES = [(bf16, bf16, False), (fp16, fp16, False), (fp32, fp32, False), (bf16, fp32, False),
           (bf16, bf16, True), (fp16, fp16, True), (fp16, fp32, True)]
SUMSQ = [bf16, fp16, fp32]
# (buffer, grad, stochastic rounding, first): the buffer is not read on the first micro-batch.
ACCUMULATES = [(bf16, bf16, False, False), (bf16, bf16, True, False), (bf16, fp32, True, False),
               (fp16, fp16, True, False), (fp32, fp32, False, False), (bf16, bf16, False, True)]

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
mismatches = specialisation_mismatches([
    # (param, grad, lr, inv_scale, clip_value, clip_coef, weight_decay, found_inf,
    #  skip_if, stochastic_rounding, seed, seed_step, offset); offsets divisible by 16 and
    #  past 2**32, and 1 (neither specialised)
    (k.lomo_update_kernel, m.lomo_update_args(LOMO_UPDATE.Arguments(
        torch.empty(2 * m.BLOCK + 5, dtype=bf16), torch.empty(2 * m.BLOCK + 5),
        torch.full((1,), 0.1), None, None, None, 0.0, torch.zeros(1), None, True, 7,
        torch.zeros(1, dtype=torch.int64), 2**32 + 16))),
    (k.lomo_update_kernel, m.lomo_update_args(LOMO_UPDATE.Arguments(
        torch.empty(2 * m.BLOCK + 5, dtype=fp16), torch.empty(2 * m.BLOCK + 5, dtype=fp16),
        torch.full((1,), 0.1), None, None, None, 0.0, None, None, True, 2**63 + 17, None,
        1))),
    # (grad, inv_scale, sumsq, found_inf)
    (k.grad_sumsq_kernel, m.grad_sumsq_args(GRAD_SUMSQ.Arguments(
        torch.empty(4 * m.BLOCK + 1, dtype=fp16), torch.full((1,), 0.5), torch.zeros(1),
        None))),
    # (buffer, grad, first, inv_scale, sumsq, found_inf, stochastic_rounding, seed,
    #  seed_step, offset)
    (k.grad_accumulate_kernel, m.grad_accumulate_args(GRAD_ACCUMULATE.Arguments(
        torch.empty(2 * m.BLOCK + 5, dtype=bf16), torch.empty(2 * m.BLOCK + 5), False,
        torch.full((1,), 0.5), torch.zeros(1), None, True, 7,
        torch.zeros(1, dtype=torch.int64), 48))),
])

runtime_constexprs = {
    kernel.__name__: sorted(p.name for p in kernel.params if p.is_constexpr)
    for kernel in (k.lomo_update_kernel, k.grad_sumsq_kernel, k.grad_accumulate_kernel)
}
print(json.dumps({"records": records, "mismatches": mismatches,
                  "checked_spec": CHECKS_SPECIALISATION,
                  "constexprs": runtime_constexprs,
                  "elems_per_thread": m.BLOCK // (32 * m.NUM_WARPS)}))
"""
)

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
    assert all("n_bulk" in r["divisible"] for r in compiled["records"])


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


# ----------------------------------------------------------------------------- 8-bit buffer

# The 8-bit blockwise buffer's kernels (`int8_buffer_kernels.py`), compiled as the JIT
# specialises them. The accumulation's tiles are whole blocks, so its accesses can be 128 bits
# wide only when the buffer's first element lies 16-aligned in its block (offset % 256 a
# multiple of 16: 0 or 16 here; 300 and 1 compile too); the update and the dequantisation
# follow the parameter's own alignment, at any offset.
_INT8_SCRIPT = (
    _PRELUDE
    + r"""
from lomo_kernels.ops.lomo.spec import GRAD_ACCUMULATE_INT8, INT8_DEQUANTIZE, LOMO_UPDATE_INT8
from lomo_kernels.kernels.triton import int8_buffer_kernels as k

# (grad, stochastic rounding, first, offset)
ACCUMULATES = [(fp32, False, False, 0), (bf16, True, False, 0), (fp16, False, True, 0),
               (bf16, True, False, 16), (fp32, False, False, 300), (bf16, True, True, 1)]
# (param, stochastic rounding, offset)
UPDATES = [(bf16, True, 300), (fp16, False, 300), (fp32, False, 2**32 + 5)]
# (out, offset)
DEQUANTIZES = [(bf16, 300), (fp16, 0), (fp32, 300)]

records = []
for arch in (80, 90):
    for grad, sr, first, offset in ACCUMULATES:
        rec = compile_one(*m.aot_grad_accumulate_int8(grad, first=first, stochastic_rounding=sr,
                                                      offset=offset), arch)
        rec.update(kernel="accumulate" + ("-first" if first else ""), dtype=str(grad), sr=sr,
                   offset=offset, arch=arch)
        records.append(rec)
    for param, sr, offset in UPDATES:
        rec = compile_one(*m.aot_update_int8(param, stochastic_rounding=sr, offset=offset), arch)
        rec.update(kernel="update", dtype=str(param), sr=sr, offset=offset, arch=arch)
        records.append(rec)
    for out, offset in DEQUANTIZES:
        rec = compile_one(*m.aot_int8_dequantize(out, offset=offset), arch)
        rec.update(kernel="dequantize", dtype=str(out), sr=False, offset=offset, arch=arch)
        records.append(rec)


def buffer(n, offset):
    return torch.empty(n, dtype=torch.int8), torch.empty(m.blocks_of(offset, n))


n = 2 * m.BLOCK + 5
mismatches = specialisation_mismatches([
    # (codes, scales, grad, offset, first, inv_scale, sumsq, found_inf, stochastic_rounding,
    #  seed, seed_step)
    (k.grad_accumulate_int8_kernel, m.grad_accumulate_int8_args(GRAD_ACCUMULATE_INT8.Arguments(
        *buffer(n, 16), torch.empty(n, dtype=bf16), 16, False, torch.ones(1), torch.zeros(1),
        None, True, 7, torch.zeros(1, dtype=torch.int64)))),
    (k.grad_accumulate_int8_kernel, m.grad_accumulate_int8_args(GRAD_ACCUMULATE_INT8.Arguments(
        *buffer(n, 2**32 + 1), torch.empty(n), 2**32 + 1, True, None, None, torch.zeros(1),
        False, 0, None))),
    # (param, codes, scales, offset, lr, inv_scale, clip_value, clip_coef, weight_decay,
    #  found_inf, skip_if, stochastic_rounding, seed, seed_step)
    (k.lomo_update_int8_kernel, m.lomo_update_int8_args(LOMO_UPDATE_INT8.Arguments(
        torch.empty(n, dtype=bf16), *buffer(n, 1), 1, torch.full((1,), 0.1), None, None, None,
        0.0, torch.zeros(1), None, True, 2**63 + 17, None))),
    # (out, codes, scales, offset)
    (k.int8_dequantize_kernel, m.int8_dequantize_args(INT8_DEQUANTIZE.Arguments(
        torch.empty(n, dtype=fp16), *buffer(n, 256), 256))),
])
kernels = (k.grad_accumulate_int8_kernel, k.lomo_update_int8_kernel, k.int8_dequantize_kernel)
print(json.dumps({"records": records, "mismatches": mismatches,
                  "checked_spec": CHECKS_SPECIALISATION,
                  "constexprs": {kernel.__name__: sorted(p.name for p in kernel.params
                                                         if p.is_constexpr)
                                 for kernel in kernels},
                  "elems_per_thread": m.BLOCK // (32 * m.NUM_WARPS)}))
"""
)


@pytest.fixture(scope="module")
def compiled_int8(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cubin = tmp_path_factory.mktemp("aot_int8") / "kernel.cubin"
    return run_compile_script(_INT8_SCRIPT, str(cubin))


def _int8_ids(compiled: dict) -> list[str]:
    return [
        f"{r['kernel']}-{r['dtype']}-sr{r['sr']}-at{r['offset']}-sm{r['arch']}"
        for r in compiled["records"]
    ]


def test_int8_every_variant_compiled_for_both_architectures(compiled_int8: dict) -> None:
    ids = _int8_ids(compiled_int8)
    assert len(ids) == len(set(ids)) == 24


def test_int8_no_local_memory(compiled_int8: dict) -> None:
    for rec, name in zip(compiled_int8["records"], _int8_ids(compiled_int8), strict=True):
        assert rec["local"] == 0, name
        assert rec["sass_local"] in (None, 0), name


def test_int8_loads_and_stores_are_128_bit_where_aligned(compiled_int8: dict) -> None:
    """Every byte of the aligned part moves in 16-byte vectors: the gradient, parameter or
    output at their width, the codes (one byte an element) in one vector per thread."""
    per_thread = compiled_int8["elems_per_thread"]
    codes_bytes = per_thread
    for rec, name in zip(compiled_int8["records"], _int8_ids(compiled_int8), strict=True):
        data_bytes = per_thread * _ITEMSIZE[rec["dtype"]]
        if rec["kernel"].startswith("accumulate"):
            if rec["offset"] % 16:
                assert "lead" not in rec["divisible"], name
                continue
            assert "lead" in rec["divisible"], name
            read = data_bytes + (0 if rec["kernel"].endswith("first") else codes_bytes)
            assert rec["ld_v4"] == read // 16, name
            assert rec["st_v4"] == codes_bytes // 16, name
        elif rec["kernel"] == "update":
            assert "n_bulk" in rec["divisible"], name
            assert rec["ld_v4"] == (data_bytes + codes_bytes) // 16, name
            assert rec["st_v4"] == data_bytes // 16, name
        else:
            assert "n_bulk" in rec["divisible"], name
            assert rec["ld_v4"] == codes_bytes // 16, name
            assert rec["st_v4"] == data_bytes // 16, name


def test_int8_aot_specialisation_matches_jit(compiled_int8: dict) -> None:
    if not compiled_int8["checked_spec"]:
        pytest.skip("this triton has no native_specialize_impl to compare with")
    assert compiled_int8["mismatches"] == []


def test_int8_runtime_values_are_not_constexpr(compiled_int8: dict) -> None:
    """Sizes, offsets, seeds and scalars are runtime arguments (offset % 256 too: the JIT
    only specialises its divisibility by 16, as it does a size's)."""
    assert compiled_int8["constexprs"] == {
        "grad_accumulate_int8_kernel": sorted(
            ["FIRST", "GRAD_KIND", "STOCHASTIC_ROUNDING", "ROWS"]
        ),
        "lomo_update_int8_kernel": sorted(
            ["PARAM_KIND", "HAS_CLIP_VALUE", "STOCHASTIC_ROUNDING", "ROWS"]
        ),
        "int8_dequantize_kernel": sorted(["OUT_KIND", "ROWS"]),
    }
