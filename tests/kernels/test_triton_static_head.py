"""Static GPU checks of the fused linear + cross-entropy Triton kernels, without a GPU.

Each kernel is compiled ahead of time for sm_80 and sm_90 with the tiles and native operand
types the GPU launcher uses, and the PTX is checked: bf16/fp16 logit tiles are multiplied on
the tensor cores (``mma.sync`` on sm_80, ``wgmma`` on sm_90), fp32 stays off them (IEEE
fp32, no TF32), and nothing lives in local memory (no register spills).
"""

from __future__ import annotations

import pytest
from support.aot import run_compile_script
from support.dependencies import require

require("triton")

_COMPILE_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from lomo_kernels.ops.cross_entropy import triton_backend as m
from lomo_kernels.kernels.triton import linear_cross_entropy_kernels as k
from lomo_kernels.kernels.triton.runtime import KIND
import torch

TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SCALARS = ("n_tokens", "n_vocab", "width", "stride_h", "stride_w", "ignore_index",
           "vocab_start")
records = []
for arch in (80, 90):
    for name, dtype in TYPES.items():
        for fn in (k.forward_kernel, k.backward_kernel):
            constexprs = {**m.GPU_TILES, "KIND": KIND[dtype], "NATIVE": True}
            if fn is k.backward_kernel:  # both outputs, as the unowned head's backward
                constexprs.update(WITH_D_HIDDEN=True, WITH_D_WEIGHT=True)
            signature = {}
            for p in fn.params:
                if p.is_constexpr:
                    signature[p.name] = "constexpr"
                elif p.name in SCALARS:
                    signature[p.name] = "i32"
                elif p.name == "temperature":
                    signature[p.name] = "fp32"
                elif p.name in ("hidden_ptr", "weight_ptr"):
                    signature[p.name] = "*" + name
                elif p.name == "labels_ptr":
                    signature[p.name] = "*i64"
                else:
                    signature[p.name] = "*fp32"
            src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                 options={"num_warps": 4}).asm["ptx"]
            records.append({
                "arch": arch, "dtype": name, "kernel": fn.__name__,
                "mma": len(re.findall(r"\bmma\.sync", ptx)),
                "wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx)),
                "local": len(re.findall(r"\.local\b", ptx)),
            })
print(json.dumps({"records": records}))
"""


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return run_compile_script(_COMPILE_SCRIPT)["records"]


def test_every_variant_compiles_for_both_architectures(records: list[dict]) -> None:
    keys = {(r["arch"], r["dtype"], r["kernel"]) for r in records}
    assert len(keys) == len(records) == 2 * 3 * 2


def test_half_precision_tiles_use_tensor_cores_and_fp32_does_not(records: list[dict]) -> None:
    for r in records:
        tensor_core = r["mma"] if r["arch"] == 80 else r["wgmma"]
        if r["dtype"] == "fp32":
            assert r["mma"] == r["wgmma"] == 0, r
        else:
            assert tensor_core > 0, r


def test_no_local_memory(records: list[dict]) -> None:
    assert all(r["local"] == 0 for r in records), records
