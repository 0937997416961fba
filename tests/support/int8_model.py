"""An independent float64 model of the 8-bit blockwise accumulation buffer, written from
`lomo_kernels/core/int8_blocks.py`'s description (tests/ops/test_grad_accumulate_int8.py).

The model never calls the package: an element's block comes from its flat index in the whole
parameter, a block's scale is the smallest power of two ``2**e`` (``e >= -126``) with
``absmax <= 127 * 2**e``, found with `math.frexp`, and an element's two code neighbours are
floor and ceil of value / scale in float64, exact (a power-of-two scale, an fp32 value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The format's constants, restated from its description rather than imported.
BLOCK = 256
MAX_CODE = 127
MIN_EXPONENT = -126
NAN = float("nan")


def block_index(offset: int, n: int) -> torch.Tensor:
    """Each of a buffer's n elements' block, counted from the buffer's first (possibly
    partial) block: the parameter's flat index offset + j cut every BLOCK elements."""
    flat = torch.arange(n, dtype=torch.int64) + offset
    return flat // BLOCK - offset // BLOCK


def block_count(offset: int, n: int) -> int:
    """The scales of a buffer of n elements at flat offset: the blocks it touches."""
    return 0 if n == 0 else (offset + n - 1) // BLOCK - offset // BLOCK + 1


def power_of_two_scale(absmax: float) -> float:
    """A block's scale from its largest magnitude: 0 for an all-zero block, nan for one
    holding an inf or nan, else the smallest 2**e, e >= -126, with absmax <= 127 * 2**e."""
    if absmax == 0:
        return 0.0
    if not math.isfinite(absmax):
        return NAN
    _, k = math.frexp(absmax)  # absmax = f * 2**k, f in [0.5, 1)
    # 127 * 2**(k - 8) < 2**(k - 1) <= absmax < 2**k < 127 * 2**(k - 6): e is k - 7 or k - 6.
    e = k - 7 if absmax <= MAX_CODE * 2.0 ** (k - 7) else k - 6
    return 2.0 ** max(e, MIN_EXPONENT)


def dequantised(codes: torch.Tensor, scales: torch.Tensor, offset: int) -> torch.Tensor:
    """The buffer's values code * scale in float64 (exact; nan in a nan-scale block)."""
    flat = codes.reshape(-1)
    return flat.double() * scales.double()[block_index(offset, flat.numel())]


def fp32_new(
    grad: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offset: int, first: bool
) -> torch.Tensor:
    """The fp32 values the op quantises, in float64: fp32(grad), or code * scale + fp32(grad)
    rounded once to fp32. The float64 sum is exact unless the two are more than 29 binades
    apart, when the smaller is below a quarter of the fp32 spacing of the larger and neither
    rounding can reach a halfway point: the two roundings give the single one."""
    g = grad.reshape(-1).double()
    exact = g if first else dequantised(codes, scales, offset) + g
    return exact.float().double()


@dataclass
class Quantised:
    """What the buffer stores for `values` (float64 holding fp32 values) at `offset`."""

    values: torch.Tensor  # float64, the fp32 values quantised
    blocks: torch.Tensor  # int64, each element's block
    scales: torch.Tensor  # float64, one per block: 0, a power of two, or nan
    ratio: torch.Tensor  # float64, value / scale (0 in zero and non-finite blocks)

    @property
    def finite_block(self) -> torch.Tensor:
        """Per element: its block's scale is finite (the codes there are neighbours)."""
        return self.scales.isfinite()[self.blocks]

    @property
    def below(self) -> torch.Tensor:
        return torch.floor(self.ratio)

    @property
    def above(self) -> torch.Tensor:
        return torch.ceil(self.ratio)

    @property
    def nearest(self) -> torch.Tensor:
        """Codes rounded to nearest, ties to even (torch.round of an exact float64)."""
        return torch.round(self.ratio)


def quantise(values: torch.Tensor, offset: int) -> Quantised:
    """The model of the store of fp32 `values` (float64) into a buffer at `offset`."""
    n = values.numel()
    blocks = block_index(offset, n)
    count = block_count(offset, n)
    magnitude = torch.where(values.isnan(), math.inf, values.abs())  # amax drops no nan
    absmax = torch.zeros(count, dtype=torch.float64)
    absmax = absmax.scatter_reduce(0, blocks, magnitude, "amax").tolist()
    scales = torch.tensor([power_of_two_scale(a) for a in absmax], dtype=torch.float64)
    scale = scales[blocks] if n else torch.zeros(0, dtype=torch.float64)
    usable = scale.isfinite() & (scale > 0)
    ratio = torch.where(usable, values / torch.where(usable, scale, 1.0), 0.0)
    assert bool((ratio.abs() <= MAX_CODE).all()), "a scale below the rule's"
    return Quantised(values, blocks, scales, ratio)


def stored_values(codes: torch.Tensor, scales: torch.Tensor, offset: int) -> torch.Tensor:
    """The stored buffer's values as fp32 (what a reader of it sees)."""
    return dequantised(codes, scales, offset).float()


def assert_scales(got: torch.Tensor, model: Quantised) -> None:
    """The stored scales are the model's: equal powers of two, zeros and nans in place."""
    want = model.scales
    g = got.double()
    assert torch.equal(g.isnan(), want.isnan()), "nan scales differ"
    finite = want.isfinite()
    bad = (g != want) & finite
    assert not bool(bad.any()), (
        f"{int(bad.sum())} scales differ; first at block {int(bad.nonzero()[0])}: "
        f"{g[bad][0].item()!r} != {want[bad][0].item()!r}"
    )


def assert_codes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """int8 codes equal to float64 `want`, elementwise."""
    g = got.reshape(-1).double()
    bad = g != want
    assert not bool(bad.any()), (
        f"{int(bad.sum())} codes not {what}; first at {int(bad.nonzero()[0])}: "
        f"{g[bad][0].item()!r} != {want[bad][0].item()!r}"
    )


def assert_nearest(codes: torch.Tensor, scales: torch.Tensor, model: Quantised) -> None:
    """Scales as the model's; codes its nearest-even ones, 0 in non-finite blocks."""
    assert_scales(scales, model)
    want = torch.where(model.finite_block, model.nearest, 0.0)
    assert_codes(codes, want, "the nearest even")


def assert_neighbours(codes: torch.Tensor, scales: torch.Tensor, model: Quantised) -> None:
    """Scales as the model's; each code floor or ceil of value / scale, 0 in non-finite
    blocks."""
    assert_scales(scales, model)
    c = codes.reshape(-1).double()
    ok = (c == model.below) | (c == model.above)
    ok = torch.where(model.finite_block, ok, c == 0)
    assert bool(ok.all()), f"{int((~ok).sum())} codes are no neighbour of value / scale"


def sr_offsets(codes: torch.Tensor, model: Quantised) -> torch.Tensor:
    """code - value / scale, in steps of the block's scale: one term of `sr_mean_bound`."""
    return codes.reshape(-1).double() - model.ratio


def sr_mean_bound(samples: int) -> float:
    """Bound on |mean of sr_offsets| over independent stochastic roundings: each term takes
    -f or 1 - f, of mean 0 and variance f (1 - f) <= 1/4, so 6 standard deviations of the
    mean are 3 / sqrt(samples) (a chance failure below 2e-9); plus the rule's own bias: 16
    centred random bits make the probability of rounding up f rounded to a multiple of
    2**-16, within 2**-17 of it."""
    return 3.0 / math.sqrt(samples) + 2.0**-17


def random_codes(n: int, gen: torch.Generator) -> torch.Tensor:
    """int8 codes in [-127, 127], uniform."""
    return torch.randint(-MAX_CODE, MAX_CODE + 1, (n,), generator=gen, dtype=torch.int8)


def random_scales(count: int, gen: torch.Generator, low: int, high: int) -> torch.Tensor:
    """fp32 powers of two 2**e, e uniform in [low, high]."""
    e = torch.randint(low, high + 1, (count,), generator=gen)
    return torch.pow(2.0, e.double()).float()
