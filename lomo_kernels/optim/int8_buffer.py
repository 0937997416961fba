"""The 8-bit blockwise accumulation buffer on the host side: its tensors, and the three
things the step does with one (add a gradient, measure it, read it for an update).

``accumulation_dtype=torch.int8`` keeps each trained parameter's (or this rank's slice's)
accumulated gradient as int8 codes and one power-of-two fp32 scale per 256-element block of
the parameter's flat index (`core/int8_blocks.py`): 1.016 bytes per element instead of 2
(bf16) or 4 (fp32). A slice's blocks are the parameter's, cut at the slice's edges, so each
rank's buffer is its own; a row block of a weight (the logits-free head's vocabulary chunks)
writes its rows of the weight's one buffer, and a block it only partly covers is re-rounded
whole (`add`). Adding is one fused pass (`ops.grad_accumulate_int8_`); Lomo's update reads
the codes in its own fused pass (`ops.lomo_update_int8_`); an update that is not elementwise
(AdaLomo's factored statistics) reads the buffer dequantised into a transient of the
parameter's size, exact in fp32 and bf16 (`dequantized`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.int8_blocks import INT8_BLOCK, blocks_of
from ..ops.lomo import grad_accumulate_int8_op, grad_sumsq_op, int8_dequantize_op

# Elements dequantised at a time where a buffer is only measured (a whole vocabulary x
# hidden head weight in fp32 would be the step's largest tensor): 64 MiB of fp32.
MEASURE_CHUNK = 16 * 2**20


@dataclass
class Int8Buffer:
    """A parameter's (or its slice's) 8-bit buffer: `codes` in the target's shape, `scales`
    one per block touched, the slice starting at flat `offset` of the parameter."""

    codes: torch.Tensor
    scales: torch.Tensor
    offset: int

    @classmethod
    def like(cls, target: torch.Tensor, offset: int, zeroed: bool) -> Int8Buffer:
        """A buffer for `target` (uninitialised unless `zeroed`: all values 0)."""
        make = torch.zeros if zeroed else torch.empty
        codes = make(target.shape, dtype=torch.int8, device=target.device)
        scales = make(blocks_of(offset, target.numel()), dtype=torch.float32, device=target.device)
        return cls(codes, scales, offset)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def numel(self) -> int:
        return self.codes.numel()

    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()

    def zero_(self) -> None:
        self.codes.zero_()
        self.scales.zero_()

    def part(self, start: int, stop: int) -> Int8Buffer:
        """Elements [start, stop) (flat, relative to this buffer) as a buffer of their own:
        views of the codes and of the scales of the blocks they touch."""
        lead = self.offset % INT8_BLOCK
        first = (lead + start) // INT8_BLOCK
        count = blocks_of(self.offset + start, stop - start)
        return Int8Buffer(
            self.codes.view(-1)[start:stop],
            self.scales[first : first + count],
            self.offset + start,
        )

    def covers_whole_blocks(self, start: int, stop: int) -> bool:
        """Whether [start, stop) cuts no block that the rest of this buffer shares."""
        inner = lambda i: i in (0, self.numel()) or (self.offset + i) % INT8_BLOCK == 0  # noqa: E731
        return inner(start) and inner(stop)

    def block_bounds(self, start: int, stop: int) -> tuple[int, int]:
        """[start, stop) widened to the edges of the blocks it touches (within the buffer)."""
        lead = self.offset % INT8_BLOCK
        low = max(0, (lead + start) // INT8_BLOCK * INT8_BLOCK - lead)
        high = min(self.numel(), -(-(lead + stop) // INT8_BLOCK) * INT8_BLOCK - lead)
        return low, high


def add(
    buffer: Int8Buffer,
    grad: torch.Tensor,
    start: int,
    first: bool,
    measure: tuple[torch.Tensor | None, torch.Tensor],
    rounding: tuple[bool, int, torch.Tensor | None],
    inv_scale: torch.Tensor | None,
    backend: Any,
) -> None:
    """Adds `grad` into elements [start, start + grad.numel()) of `buffer` in one fused pass;
    `measure`: (sumsq, or None not to measure; found_inf); `rounding`: (stochastic, seed,
    seed_step). A range that cuts a block the rest of the buffer shares is widened to whole
    blocks with zeros around the gradient (the other elements are re-rounded under the
    block's new scale); such a range is not measured (the caller measures the buffer whole
    afterwards, `measure_sumsq`)."""
    stop = start + grad.numel()
    sumsq, found_inf = measure
    if not buffer.covers_whole_blocks(start, stop):
        if sumsq is not None:
            raise AssertionError("a range that cuts the 8-bit buffer's blocks was measured")
        low, high = buffer.block_bounds(start, stop)
        widened = torch.zeros(high - low, dtype=torch.float32, device=grad.device)
        widened[start - low : stop - low] = grad.reshape(-1)
        grad, start, stop, first = widened, low, high, False
    part = buffer.part(start, stop)
    stochastic, seed, seed_step = rounding
    # In the op's order (GRAD_ACCUMULATE_INT8.names), every value the optimizer's own.
    grad_accumulate_int8_op.call_in_order(
        backend,
        (
            part.codes,  # codes
            part.scales,  # scales
            grad.reshape(-1).contiguous(),  # grad
            part.offset,  # offset
            first,  # first
            inv_scale,  # inv_scale
            sumsq,  # sumsq
            found_inf,  # found_inf
            stochastic,  # stochastic_rounding
            seed if stochastic else 0,  # seed
            seed_step if stochastic else None,  # seed_step
        ),
    )


def dequantized(buffer: Int8Buffer, dtype: torch.dtype, backend: Any) -> torch.Tensor:
    """The buffer's values in a new tensor of `dtype`, shaped as its codes (exact in fp32
    and bf16; an fp16 parameter's reads fp32, its range being narrower than the scales')."""
    if dtype == torch.float16:
        dtype = torch.float32
    out = torch.empty(buffer.codes.shape, dtype=dtype, device=buffer.device)
    if out.numel():
        int8_dequantize_op.call_in_order(backend, (out, buffer.codes, buffer.scales, buffer.offset))
    return out


def measure_sumsq(
    buffer: Int8Buffer,
    sumsq: torch.Tensor,
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor | None,
    backend: Any,
) -> None:
    """Adds the buffer's scaled sum of squares and inf/nan flag, dequantised
    `MEASURE_CHUNK` elements at a time."""
    n = buffer.numel()
    for start in range(0, n, MEASURE_CHUNK):
        values = dequantized(buffer.part(start, min(n, start + MEASURE_CHUNK)), torch.float32,
                             backend)  # fmt: skip
        grad_sumsq_op.call_in_order(backend, (values.view(-1), inv_scale, sumsq, found_inf))
