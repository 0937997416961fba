"""How stochastically rounded results fall between the two neighbours of their exact values."""

from __future__ import annotations

import torch

from lomo_kernels.core.rounding import round_to_dtype

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the dtypes stochastic rounding serves


def neighbour_counts(
    out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype
) -> tuple[float, float, float]:
    """(ups, expected ups, variance) of rounding the fp32 `exact` to `out`, elementwise; fails
    unless every element of `out` is one of the two neighbours of its `exact` value."""
    lower = round_to_dtype(exact, dtype, torch.zeros(exact.shape, dtype=torch.int64))
    lower64, exact64, out64 = lower.double(), exact.double(), out.double()
    # The upper neighbour: the rounding with every random bit set, unless exact is on the grid.
    upper = round_to_dtype(exact, dtype, torch.full(exact.shape, 65535, dtype=torch.int64))
    upper64 = upper.double()
    on_grid = upper64 == lower64
    assert bool(((out64 == lower64) | (out64 == upper64)).all()), "not a neighbour"
    spacing = torch.where(on_grid, torch.ones_like(exact64), upper64 - lower64)
    frac = torch.where(on_grid, torch.zeros_like(exact64), (exact64 - lower64) / spacing)
    ups = float((~on_grid & (out64 == upper64)).sum())
    return ups, float(frac.sum()), float((frac * (1 - frac)).sum())
