"""The 8-bit blockwise buffer's ops run by a backend module on a device against the reference
on the CPU (tests/kernels/test_cuda.py): inputs whose blocks span every scale regime, placed so
a kernel takes its vector or its scalar path, and the bit-for-bit comparisons.

A backend module takes the ops' arguments positionally in the specs' order
(`lomo_kernels.ops.lomo.spec`), runtime scalars as 1-element tensors on the data's device, as
`lomo_kernels.ops.lomo.reference` does.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from lomo_kernels.core.int8_blocks import INT8_BLOCK, blocks_of
from lomo_kernels.ops.lomo import reference

from .lomo_bitwise import assert_same_bits

SIZES = [1, 7, 255, 256, 257, 4097]
OFFSETS = [0, 1, 255, 256, 300, 2**32 + 5]
# A size of many CTAs' grid-stride loops, at two offsets only (the reference takes its time).
LARGE_SIZE = 278011
LARGE_OFFSETS = [0, 2**32 + 5]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Where the data sits in its allocation: fresh tensors; shifted by lead % 16 elements, so the
# buffer is 128-bit aligned where its parameter's blocks start (the accumulation's vectors
# apply for any offset); the codes one byte further (no common alignment: scalar paths).
LAYOUTS = ["fresh", "block_aligned", "misaligned"]
SEED, STEP = 7, 12345
# fp32 summation against the reference's float64 (as the other CUDA sum-of-squares checks).
SUMSQ_RTOL = 1e-5


def sizes_at(offset: int, large: bool = True) -> list[int]:
    """The sizes checked at `offset`: SIZES, and LARGE_SIZE at LARGE_OFFSETS when `large`."""
    return SIZES + ([LARGE_SIZE] if large and offset in LARGE_OFFSETS else [])


def placed(values: torch.Tensor, shift: int, device: str) -> torch.Tensor:
    """`values` on `device`, `shift` elements into a fresh allocation (a contiguous view)."""
    storage = torch.zeros(values.numel() + shift, dtype=values.dtype, device=device)
    view = storage[shift:]
    view.copy_(values.reshape(-1))
    return view


def shifts(layout: str, offset: int) -> tuple[int, int]:
    """(codes shift, data shift) of a layout for a buffer at flat `offset`."""
    lead = offset % INT8_BLOCK % 16
    return {"fresh": (0, 0), "block_aligned": (lead, lead), "misaligned": (lead + 1, lead)}[layout]


def block_exponents(blocks: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A power-of-two magnitude per parameter block: random over the dtype's range, with an
    all-zero block, one at fp32's subnormals (the scale's exponent floor) where the dtype has
    them, and ties-to-even (scale 1) blocks left to `blockwise_values`."""
    low, high = (-20, 8) if dtype == torch.float16 else (-60, 60)
    exponents = torch.randint(low, high, (blocks,), generator=gen).to(torch.float64)
    exponents[2::7] = float("-inf")  # 2**-inf = 0: all-zero blocks
    if dtype != torch.float16:
        exponents[3::11] = -140.0
    return exponents


def blockwise_values(
    n: int, offset: int, dtype: torch.dtype, seed: int, ties: bool = True
) -> torch.Tensor:
    """n values of `dtype` for the slice at flat `offset`, each parameter block of one
    magnitude; block 1 (when there) holds halves up to 127, which round as ties (scale 1)."""
    gen = torch.Generator().manual_seed(seed)
    lead = offset % INT8_BLOCK
    blocks = (torch.arange(n) + lead) // INT8_BLOCK
    exponents = block_exponents(blocks_of(offset, n), dtype, gen)
    values = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(exponents[blocks])
    tie_block = blocks == 1
    if ties and bool(tie_block.any()):
        count = int(tie_block.sum())
        halves = torch.arange(count, dtype=torch.float64) % 254 - 126.5
        halves[0] = 127.0
        values[tie_block] = halves
    return values.to(dtype)


def with_non_finite(grad: torch.Tensor, where: str) -> torch.Tensor:
    """A copy with an inf or nan at the first, a middle or the last element, or in each of
    several blocks ('spread')."""
    out = grad.clone()
    n = out.numel()
    if where == "first":
        out[0] = float("inf")
    elif where == "middle":
        out[n // 2] = float("nan")
    elif where == "last":
        out[n - 1] = float("-inf")
    else:
        out[:: max(1, n // 5)] = float("nan")
    return out


def scalar(value: float | None, device: str) -> torch.Tensor | None:
    return None if value is None else torch.tensor([value], dtype=torch.float32, device=device)


class Int8Buffer:
    """The codes and scales of a buffer of n elements at flat `offset`, on `device`."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offset: int) -> None:
        self.codes, self.scales, self.offset = codes, scales, offset

    @classmethod
    def empty(cls, n: int, offset: int, device: str, codes_shift: int = 0) -> Int8Buffer:
        codes = placed(torch.zeros(n, dtype=torch.int8), codes_shift, device)
        scales = torch.zeros(blocks_of(offset, n), dtype=torch.float32, device=device)
        return cls(codes, scales, offset)

    def to(self, device: str, codes_shift: int = 0) -> Int8Buffer:
        return Int8Buffer(
            placed(self.codes.cpu(), codes_shift, device), self.scales.to(device), self.offset
        )

    def assert_same(self, other: Int8Buffer) -> None:
        assert torch.equal(self.codes.cpu(), other.codes.cpu()), "codes differ"
        assert_same_bits(self.scales.cpu(), other.scales.cpu())


def accumulate(
    module: ModuleType,
    buffer: Int8Buffer,
    grad: torch.Tensor,
    *,
    first: bool,
    stochastic: bool,
    inv_scale: float | None = 0.5,
) -> tuple[float, float]:
    """`module`'s grad_accumulate_int8_ into `buffer` on grad's device; (sumsq, found_inf)."""
    device = str(grad.device)
    sumsq, found = torch.zeros(1, device=device), torch.zeros(1, device=device)
    step = torch.tensor([STEP], dtype=torch.int64, device=device)
    module.grad_accumulate_int8_(
        buffer.codes, buffer.scales, grad, buffer.offset, first, scalar(inv_scale, device),
        sumsq, found, stochastic, SEED, step,
    )  # fmt: skip
    return float(sumsq), float(found)


def check_accumulate(
    module: ModuleType,
    device: str,
    n: int,
    offset: int,
    grad_dtype: torch.dtype,
    stochastic: bool,
    layout: str,
    non_finite: str | None = None,
) -> None:
    """Two micro-batches (first, then added) by `module` on `device` and by the reference on
    the CPU: the same codes and scales bit for bit, found_inf equal, sumsq within fp32
    summation of the reference's float64 sum."""
    codes_shift, grad_shift = shifts(layout, offset)
    want = Int8Buffer.empty(n, offset, "cpu")
    got = Int8Buffer.empty(n, offset, device, codes_shift)
    for step, first in enumerate((True, False)):
        grad = blockwise_values(n, offset, grad_dtype, seed=n + step, ties=first)
        if non_finite is not None and not first:
            grad = with_non_finite(grad, non_finite)
        want_sumsq, want_found = accumulate(
            reference, want, grad, first=first, stochastic=stochastic
        )
        got_sumsq, got_found = accumulate(
            module, got, placed(grad, grad_shift, device), first=first, stochastic=stochastic
        )
        got.assert_same(want)
        assert got_found == want_found
        assert got_sumsq == pytest.approx(want_sumsq, rel=SUMSQ_RTOL, nan_ok=True)
    if non_finite is not None:
        assert want_found == 1.0 and bool(want.scales.isnan().any())


def quantised(n: int, offset: int, seed: int, non_finite: str | None = None) -> Int8Buffer:
    """A buffer of n elements at `offset` as the reference stores a gradient (CPU)."""
    buffer = Int8Buffer.empty(n, offset, "cpu")
    grad = blockwise_values(n, offset, torch.float32, seed)
    if non_finite is not None:
        grad = with_non_finite(grad, non_finite)
    accumulate(reference, buffer, grad, first=True, stochastic=False, inv_scale=None)
    return buffer


# Option sets of the update: none, and every transform on (the gradient arrives loss-scaled).
UPDATE_OPTIONS = {
    "plain": dict(lr=1e-2, inv_scale=None, clip_value=None, clip_coef=None, weight_decay=0.0),
    "full": dict(lr=2e-2, inv_scale=2.0**-10, clip_value=1e-3, clip_coef=0.75, weight_decay=0.1),
}


def update(
    module: ModuleType,
    param: torch.Tensor,
    buffer: Int8Buffer,
    options: dict,
    *,
    stochastic: bool,
    skip: float | None = None,
) -> float:
    """`module`'s lomo_update_int8_ of `param` on its device; found_inf."""
    device = str(param.device)
    found = torch.zeros(1, device=device)
    step = torch.tensor([STEP], dtype=torch.int64, device=device)
    module.lomo_update_int8_(
        param, buffer.codes, buffer.scales, buffer.offset, scalar(options["lr"], device),
        scalar(options["inv_scale"], device), options["clip_value"],
        scalar(options["clip_coef"], device), options["weight_decay"], found,
        scalar(skip, device), stochastic, SEED, step,
    )  # fmt: skip
    return float(found)


def check_update(
    module: ModuleType,
    device: str,
    n: int,
    offset: int,
    param_dtype: torch.dtype,
    stochastic: bool,
    options: str,
    non_finite: str | None = None,
    skip: float | None = None,
    codes_shift: int = 0,
) -> None:
    """The update by `module` on `device` and by the reference on the CPU: the parameter bit
    for bit, found_inf equal (codes_shift: the codes that many bytes into their allocation)."""
    buffer = quantised(n, offset, seed=n, non_finite=non_finite)
    param = (torch.randn(n, generator=torch.Generator().manual_seed(offset % 997)) * 0.1).to(
        param_dtype
    )
    want = param.clone()
    want_found = update(reference, want, buffer, UPDATE_OPTIONS[options], stochastic=stochastic,
                        skip=skip)  # fmt: skip
    got = param.to(device)
    got_found = update(module, got, buffer.to(device, codes_shift), UPDATE_OPTIONS[options],
                       stochastic=stochastic, skip=skip)  # fmt: skip
    assert_same_bits(got.cpu(), want)
    assert got_found == want_found
    if skip:
        assert torch.equal(want, param)


def check_dequantize(
    module: ModuleType,
    device: str,
    n: int,
    offset: int,
    out_dtype: torch.dtype,
    non_finite: str | None = None,
    codes_shift: int = 0,
) -> None:
    """code * scale by `module` on `device` and by the reference: the same bits (codes_shift:
    the codes that many bytes into their allocation)."""
    buffer = quantised(n, offset, seed=n + 1, non_finite=non_finite)
    want = torch.empty(n, dtype=out_dtype)
    reference.int8_dequantize_(want, buffer.codes, buffer.scales, offset)
    got = torch.empty(n, dtype=out_dtype, device=device)
    on_device = buffer.to(device, codes_shift)
    module.int8_dequantize_(got, on_device.codes, on_device.scales, offset)
    assert_same_bits(got.cpu(), want)
