"""8-bit blockwise buffer cases (core/int8_blocks.py) that a backend module must store bit for
bit as the reference backend does, and the comparisons (tests/kernels).

The gradients put blocks of the parameter's flat index at very different magnitudes (fp32's
subnormals to near its top, each dtype within its range), with an all-zero block, a block of
exact ties (x.5 codes: half to even) and one at the scale rule's mantissa boundary
(absmax = 127 * 2^e). The buffers a pass adds into hold valid codes and scales, with an
all-zero block and a non-finite (nan-scaled) one. Backend functions take their arguments
positionally, in the reference's order.
"""

from __future__ import annotations

import functools

import torch

from lomo_kernels.core.int8_blocks import INT8_BLOCK, blocks_of
from lomo_kernels.core.rounding import pair_bits16, rounding_key
from lomo_kernels.ops.lomo import reference

from .lomo_bitwise import int_bits, run_update, scalar

# Sizes around a block (256) and neither multiples of one nor of the vector widths; offsets that
# start mid-block, at a block's last element, on a block edge, and past 2^32 (the index's high
# half in the rounding bits).
SIZES = [1, 7, 255, 256, 257, 4097, 278011]
OFFSETS = [0, 1, 255, 256, 300, 2**32 + 5]
INF, NAN = float("inf"), float("nan")
# Per-block magnitudes (powers of two), cycled over the flat blocks, within each dtype's range.
MAGNITUDES = {
    torch.float32: [1.0, 2.0**-133, 2.0**120, 2.0**-20, 3.0, 2.0**-126, 2.0**60],
    torch.bfloat16: [1.0, 2.0**-133, 2.0**120, 2.0**-20, 3.0, 2.0**-126, 2.0**60],
    torch.float16: [1.0, 2.0**-20, 2.0**10, 2.0**-14, 3.0, 2.0**-5, 2.0**4],
}
# An inverse scale per dtype that keeps the fp32 sum of squares of such values finite.
SUMSQ_INV = {torch.float32: 2.0**-70, torch.bfloat16: 2.0**-70, torch.float16: 0.375}
# Flat blocks (mod PATTERN_PERIOD) given a crafted pattern instead of random values.
ZERO_BLOCK, TIES_BLOCK, BOUNDARY_BLOCK, ABOVE_BLOCK = 7, 8, 9, 10
PATTERN_PERIOD = 11


def flat_blocks(n: int, offset: int) -> torch.Tensor:
    """Each element's block of the parameter's flat index."""
    return (offset + torch.arange(n, dtype=torch.int64)) // INT8_BLOCK


def make_int8_grad(
    n: int, dtype: torch.dtype, offset: int, seed: int, specials: bool = False
) -> torch.Tensor:
    """A gradient of n elements at flat `offset`: random values at a magnitude per flat block,
    and the crafted blocks; with `specials`, inf / -inf / nan in the first element, one past
    the middle and the last."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    blocks = flat_blocks(n, offset)
    pattern = blocks % PATTERN_PERIOD
    magnitudes = torch.tensor(MAGNITUDES[dtype], dtype=torch.float64)
    g = g * magnitudes[blocks % len(magnitudes)]
    position = ((offset + torch.arange(n)) % INT8_BLOCK).to(torch.float64)
    g = torch.where(pattern == ZERO_BLOCK, torch.zeros_like(g), g)
    # k + 0.5 up to absmax 126.5 (a whole block): the scale 1, every code a tie.
    g = torch.where(pattern == TIES_BLOCK, (position - 127.5).clamp(-126.5, 126.5), g)
    # absmax 127 * 2^-3 exactly (mantissa field 0x7E0000): the scale 2^-3, codes up to 127;
    # one fp32 ulp above it: the scale 2^-2.
    boundary = (position - 128.0).clamp(-127.0) * 2.0**-3
    g = torch.where(pattern == BOUNDARY_BLOCK, boundary, g)
    g = torch.where(pattern == ABOVE_BLOCK, boundary * (1 + 2.0**-23), g)
    out = g.to(torch.float32).to(dtype)
    if specials and n >= 3:
        out[0], out[n // 2 + 1], out[n - 1] = INF, NAN, -INF
    return out


def make_int8_buffer(
    n: int, offset: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales): valid buffer contents (the reference's first pass of a gradient of
    `dtype`'s magnitudes), with an all-zero block and, where there are three blocks or more, a
    non-finite one. Fresh copies of one computation per argument set."""
    codes, scales = _int8_buffer(n, offset, seed, dtype)
    return codes.clone(), scales.clone()


@functools.cache
def _int8_buffer(
    n: int, offset: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    grad = make_int8_grad(n, dtype, offset, seed + 101).float()
    if blocks_of(offset, n) >= 3:
        grad[(flat_blocks(n, offset) - offset // INT8_BLOCK) == 1] = 0.0
        grad[-1] = NAN
    codes = torch.empty(n, dtype=torch.int8)
    scales = torch.empty(blocks_of(offset, n), dtype=torch.float32)
    reference.grad_accumulate_int8_(
        codes, scales, grad, offset, True, None, None, None, False, 0, None
    )
    return codes, scales


def accumulate_int8_both(
    module,
    codes: torch.Tensor,
    scales: torch.Tensor,
    grad: torch.Tensor,
    offset: int,
    *,
    first: bool = False,
    inv_scale: torch.Tensor | None = None,
    sr: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    start: float = 0.75,
) -> tuple[tuple, tuple, tuple, tuple]:
    """`module.grad_accumulate_int8_` (a backend) and the reference's on copies of the buffer,
    each with sumsq (from `start`) and found_inf: ((codes), (scales), (sumsqs), (flags)),
    backend first."""
    out = []
    for m in (module, reference):
        c, s, sumsq, found = codes.clone(), scales.clone(), torch.tensor([start]), torch.zeros(1)
        m.grad_accumulate_int8_(
            c, s, grad, offset, first, inv_scale, sumsq, found, sr, seed, seed_step
        )
        out.append((c, s, sumsq, found))
    return tuple(zip(*out, strict=True))


def assert_same_buffer(codes: tuple, scales: tuple) -> None:
    """Codes equal and scales bit for bit (a non-finite block's nan included)."""
    got, want = codes
    assert torch.equal(got, want), f"{int((got != want).sum())} codes differ"
    got, want = scales
    differ = got.view(torch.int32) != want.view(torch.int32)
    assert not differ.any(), f"{int(differ.sum())} scales differ: {got[differ][:4]}"


def same_sum(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or both nan."""
    return torch.equal(a, b) or bool(a.isnan().all() and b.isnan().all())


class Int8Grad:
    """An 8-bit buffer standing in for the gradient of `run_update`: its lomo_update_ calls
    the module's lomo_update_int8_ on (codes, scales, offset)."""

    def __init__(self, module, codes: torch.Tensor, scales: torch.Tensor, offset: int) -> None:
        self.module, self.codes, self.scales, self.offset = module, codes, scales, offset

    def lomo_update_(self, param, _grad, lr, *rest) -> None:
        # rest ends with the dense op's offset: the buffer's is the 8-bit op's.
        self.module.lomo_update_int8_(param, self.codes, self.scales, self.offset, lr, *rest[:-1])


def update_int8_both(
    module,
    param: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offset: int,
    opts: dict,
    *,
    sr: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    skip: float | None = 0.0,
) -> tuple[tuple, tuple]:
    """`module.lomo_update_int8_` and the reference's on copies of `param` with the option set
    `opts` (support/lomo_bitwise.py), found_inf and skip_if (None: absent): ((params), (flags)),
    backend first."""
    params, flags = [], []
    for m in (module, reference):
        p, found = param.clone(), torch.zeros(1)
        run_update(
            Int8Grad(m, codes, scales, offset), p, None, opts, found=found,
            skip=scalar(skip), sr=sr, seed=seed, seed_step=seed_step,
        )  # fmt: skip
        params.append(p)
        flags.append(found)
    return tuple(params), tuple(flags)


def dequantize_both(
    module, out_dtype: torch.dtype, codes: torch.Tensor, scales: torch.Tensor, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`module.int8_dequantize_` and the reference's into fresh tensors of `out_dtype`."""
    outs = []
    for m in (module, reference):
        out = torch.full(codes.shape, 7.0, dtype=out_dtype)
        m.int8_dequantize_(out, codes, scales, offset)
        outs.append(out)
    return outs[0], outs[1]


def assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical but for nan payloads (nans at the same places)."""
    nan = got.isnan()
    assert torch.equal(nan, want.isnan()), "nan positions differ"
    assert torch.equal(int_bits(got)[~nan], int_bits(want)[~nan])


def stochastic_tie_case(
    n: int, offset: int, seed: int, seed_step: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad, codes): an fp32 gradient of a first stochastic pass (`seed`, `seed_step`) at
    `offset` in which every element but its block's first (127: the scale 1) is a tie,
    k + 1 - (2 r + 1) / 2**17 for r the element's own random bits and k uniform in
    [-127, 125] (exact in fp32), so that x + u = k + 1/2 for the centred offset u; and the
    codes rounding to nearest even stores, the even one of k and k + 1 (half go up)."""
    index = offset + torch.arange(n, dtype=torch.int64)
    r = pair_bits16(index, rounding_key(seed, seed_step))
    k = torch.randint(-127, 126, (n,), generator=torch.Generator().manual_seed(seed))
    grad = (k + 1).double() - (2 * r + 1).double() * 2.0**-17
    leads = (index % INT8_BLOCK == 0) | (torch.arange(n) == 0)
    codes = torch.where(leads, 127, k + 1 - (k + 1) % 2)
    return torch.where(leads, 127.0, grad).float(), codes.to(torch.int8)


def check_stochastic_ties(
    module, size: int, offset: int, seed_step: torch.Tensor | None, device: str = "cpu"
) -> None:
    """`module`'s first stochastic pass of `stochastic_tie_case` on `device` stores the tie
    rule's codes, as the reference's does on the CPU."""
    grad, want = stochastic_tie_case(size, offset, seed=size, seed_step=seed_step)
    for m, where in ((module, device), (reference, "cpu")):
        codes = torch.empty(size, dtype=torch.int8, device=where)
        scales = torch.empty(blocks_of(offset, size), device=where)
        step = None if seed_step is None else seed_step.to(where)
        m.grad_accumulate_int8_(
            codes, scales, grad.to(where), offset, True, None, None, None, True, size, step
        )
        codes = codes.cpu()
        assert torch.equal(codes, want), f"{int((codes != want).sum())} codes differ"
