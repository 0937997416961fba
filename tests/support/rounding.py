"""How stochastically rounded results fall between the two neighbours of their exact values,
the neighbours found in float64 from bit patterns (no rounding rule of the package's)."""

from __future__ import annotations

import torch

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the dtypes stochastic rounding serves


def _from_bits16(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 values of the 16-bit patterns `bits` (int32 in [0, 65535]) of `dtype`."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return signed.view(dtype).double()


def float64_neighbours(exact: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(lower, upper): the values of `dtype` next to each fp32 `exact`, toward and away from
    zero, in float64 (equal where `exact` is on the grid). Found by stepping the magnitude's
    bit pattern of torch's nearest cast one up and one down: adjacent patterns are adjacent
    values (subnormals included), and |exact| lies between the cast and one of them."""
    bits = exact.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
    sign, magnitude = bits & 0x8000, bits & 0x7FFF
    at = _from_bits16(magnitude | sign, dtype)
    below = _from_bits16((magnitude - 1).clamp_min(0) | sign, dtype)
    above = _from_bits16((magnitude + 1) | sign, dtype)
    x = exact.double().abs()
    lower = torch.where(at.abs() <= x, at, below)
    upper = torch.where(at.abs() >= x, at, above)
    return lower, upper


def assert_unbiased_neighbours(
    out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, err: torch.Tensor | None = None
) -> float:
    """Every element of `out` (stochastically rounded to `dtype`) is a neighbour of its
    exact value, and the number rounded away from zero is the sum of the fractions
    ``(|x| - |lower|) / spacing`` within 5 standard deviations (Bernoulli variances); returns
    that number. `exact`: the value the kernel rounded, or a float64 value the kernel's fp32
    one is within `err` of (elementwise): then a neighbour of any value within `err`
    counts, and each element may move the expected count by up to ``err / spacing``."""
    x = exact.double().reshape(-1)
    e = torch.zeros_like(x) if err is None else err.double().reshape(-1)
    o = out.double().reshape(-1)
    floor = torch.minimum(*float64_neighbours(x - e, dtype))
    ceil = torch.maximum(*float64_neighbours(x + e, dtype))
    off = (o < floor) | (o > ceil)
    assert not bool(off.any()), f"not a neighbour at {off.nonzero().reshape(-1)[:8].tolist()}"
    lower, upper = float64_neighbours(x, dtype)
    on_grid = upper == lower
    spacing = torch.where(on_grid, torch.ones_like(x), upper - lower).abs()
    frac = torch.where(on_grid, torch.zeros_like(x), (x - lower).abs() / spacing)
    ups = float((~on_grid & (o.abs() > x.abs())).sum())
    expected, variance = float(frac.sum()), float((frac * (1 - frac)).sum())
    slack = float((e / spacing).clamp(max=1).sum())
    assert abs(ups - expected) <= 5 * variance**0.5 + slack, (ups, expected, variance, slack)
    return ups
