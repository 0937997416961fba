"""The cases of `python -m bench.kernels` as a pytest-benchmark suite.

    pytest bench/ --benchmark-only [--benchmark-group-by=group]
    LOMO_BENCH_DEVICE=cuda pytest bench/ --benchmark-only

pytest-benchmark times one variant after the other, not interleaved: on a shared, noisy
machine prefer `python -m bench.kernels` (ratios from interleaved repetitions).
LOMO_BENCH_SIZES (e.g. "4K,1M,64M") chooses the sizes; the LLaMA-7B layer mix is always in.
"""

from __future__ import annotations

import os

import pytest
import torch

from bench.common.dtypes import DTYPES
from bench.kernels import (
    DEFAULT_SIZES,
    LAYER_CASE,
    Case,
    available_backends,
    case_numels,
    parse_size,
    size_label,
)

DEVICE = os.environ.get("LOMO_BENCH_DEVICE", "cpu")
SIZES = [parse_size(s) for s in os.environ.get("LOMO_BENCH_SIZES", "").split(",") if s] or list(
    DEFAULT_SIZES
)
CASES = [size_label(n) for n in SIZES] + [LAYER_CASE]
VARIANTS = [f"lomo_kernels[{b}]" for b in ("triton", "cpp", "torch")] + [
    "lomo_optim",
    "lomo_optim+compile",
    "torch_fused_sgd",
    "axpy_floor",
]


@pytest.fixture(scope="module", autouse=True)
def threads():
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("LOMO_BENCH_DEVICE=cuda but no CUDA device here")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


_cache: dict[tuple[str, str], Case] = {}


def _case(name: str, dtype: str) -> Case:
    if (name, dtype) not in _cache:
        _cache.clear()  # one case alive at a time: the large ones take GBs
        _cache[(name, dtype)] = Case(name, case_numels(name), DTYPES[dtype], DEVICE)
    return _cache[(name, dtype)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES)
def test_update(benchmark, case: str, dtype: str, variant: str) -> None:
    fns = _case(case, dtype).variants(available_backends(DEVICE), compile_chain=True)
    if variant not in fns:
        pytest.skip(f"{variant} is not available or left out for {case} on {DEVICE}")
    benchmark.group = f"{case}-{dtype}"
    benchmark(fns[variant])
