"""pytest-benchmark entry points for the variants of bench_update.py.

    pytest bench/test_bench_update.py --benchmark-enable --benchmark-group-by=param:dtype

LOMO_BENCH_NUMEL sets the single-tensor size (default 32M). pytest-benchmark times one
variant after the other, not interleaved: for ratios on a noisy machine prefer
`python bench/bench_update.py`.
"""

from __future__ import annotations

import os

import pytest
import torch
from bench_update import DTYPES, NUMEL, Case, llama_layer_shapes

from lomo_kernels.backends import cpp_backend

VARIANTS = ["fused", "fused_sr", "axpy", "official", "fused_sgd", "fused_sgd_amp", "reference"]


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    if not cpp_backend.is_available("cpu"):
        pytest.skip(cpp_backend.unavailable_reason("cpu"))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


_cases: dict[tuple[str, str], Case] = {}


def _case(shape: str, dtype: str) -> Case:
    key = (shape, dtype)
    if key not in _cases:
        sizes = [int(os.environ.get("LOMO_BENCH_NUMEL", NUMEL))]
        if shape == "mix":
            sizes = llama_layer_shapes()
        _cases.clear()  # one case alive at a time: 32M-element cases are large
        _cases[key] = Case(DTYPES[dtype], sizes)
    return _cases[key]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", ["single", "mix"])
def test_update(benchmark, shape: str, dtype: str, variant: str) -> None:
    fns = _case(shape, dtype).variants()
    if variant not in fns:
        pytest.skip(f"{variant} does not apply to {dtype}")
    benchmark.group = f"{shape}-{dtype}"
    benchmark(fns[variant])
