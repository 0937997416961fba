"""The 8-bit blockwise accumulation buffer's layout and quantisation rule, shared by every
backend (the reference, Triton, C++, CUDA implement exactly this).

A buffer of a parameter (or of a slice of it starting at flat `offset`) is two tensors:
`codes`, int8 in [-127, 127], one per element, and `scales`, fp32, one per block. Blocks
are the parameter's flat index cut every `INT8_BLOCK` elements, so a slice's first and last
blocks may be partial: the slice's element ``j`` lies in its block
``(offset % INT8_BLOCK + j) // INT8_BLOCK``, and it holds `blocks_of(offset, numel)` scales.
An element's value is ``codes[j] * scales[block]``.

A block's scale is the power of two ``p = 2**e`` for the smallest ``e >= -126`` with
``absmax <= 127 * p`` (absmax: the block's largest magnitude; 0 for an all-zero block, NaN
for a block holding an inf or nan). A power of two keeps the steps exact: ``code * p`` and
``value * (1 / p)`` are exact in fp32 (but for an fp32 underflow of a tiny value in a block
with a large scale), so no backend's fused multiply-add can change a code; the one rounding
left is the fp32 addition of stochastic rounding, which every backend does as its own
operation. A code is ``value / p`` rounded to nearest even, or stochastically: the fp32 sum
``value / p + u`` rounded to nearest even, with ``u = (2 r + 1 - 2**16) / 2**17`` (uniform on
(-1/2, 1/2), centred on 0) for ``r`` 16 random bits from the accumulation's stream
(`core.rounding.pair_bits16`) at the element's flat index in the whole parameter
(``offset + j``), so a slice rounds as the whole parameter would. The probability of
rounding up is the fraction rounded to a multiple of 2**-16, within 2**-17 of it (up to
2**-25 more for |value / p| < 1/2, where the fp32 sum can round onto +-1/2); a fraction
half-way between (a tie) goes to the even code, up from one code and down from the next: 0
on average.

``e`` comes from the bits of absmax alone (no division): with absmax = m * 2**E, m in [1, 2),
``e = E - 6`` when ``m <= 127 / 64`` (a 23-bit mantissa field <= 0x7E0000), else ``E - 5``.
A block whose largest magnitude exceeds 127 * 2**121 (within 0.8% of fp32's largest finite
value) takes scale 2**122, and its largest values read back as inf: the step is then skipped
as an overflow, as such a gradient's norm would overflow anyway.
"""

from __future__ import annotations

# Elements per scale: 256 int8 codes and one fp32 scale, 1.016 bytes per element.
INT8_BLOCK = 256
# The mantissa field of the largest m (in [1, 2)) with m * 64 <= 127.
INT8_MANTISSA_LIMIT = 0x7E0000
# The smallest scale exponent (fp32's smallest normal power of two).
INT8_MIN_EXPONENT = -126
INT8_MAX_CODE = 127


def blocks_of(offset: int, numel: int) -> int:
    """The scales a buffer of `numel` elements starting at flat `offset` of its parameter
    holds: the blocks of the parameter it touches (0 for an empty one)."""
    if numel <= 0:
        return 0
    lead = offset % INT8_BLOCK
    return (lead + numel + INT8_BLOCK - 1) // INT8_BLOCK


def int8_buffer_bytes(offset: int, numel: int) -> int:
    """Bytes of the codes and scales of such a buffer."""
    return numel + 4 * blocks_of(offset, numel)
