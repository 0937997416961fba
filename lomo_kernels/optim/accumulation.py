"""Gradient accumulation over micro-batches: one buffer per trainable parameter, and the step
applied from the buffers once the last micro-batch's gradients are in.

Each ``fused_backward(loss)`` of an optimizer built with ``accumulation_steps=k`` is one
micro-batch. Its backward adds every gradient into the parameter's buffer with one fused pass
(`ops.grad_accumulate_`) and frees it at once, so no ``.grad`` is ever kept; the buffer is
allocated at the parameter's first gradient of the step, in the parameter's dtype (bf16 and
fp16 rounded stochastically by default, as the write-back is) or in ``accumulation_dtype``
(``torch.int8``: the 8-bit blockwise buffer, `int8_buffer.py`).
The k-th micro-batch's pass also measures the accumulated gradients' squared norm and
inf/nan flag, so the step then knows the exact global norm without a norm pass: every
parameter is updated from its buffer with the clip coefficient of the whole big batch, or,
after an overflow in any micro-batch, none is and the loss scale is lowered once (torch's
GradScaler semantics). The buffers stay allocated for the next step, whose first gradient
overwrites each (no clearing pass, no new pages every step); `zero_grad()` and `detach()`
free them.

The buffers hold the loss-scaled sum, as ``.grad`` does under torch's GradScaler (one scale
serves the k micro-batches: the scale changes only when a step is applied); the update
divides by the scale as it divides a gradient.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .. import ops
from ..core.checks import SUPPORTED_DTYPES
from ..core.rounding import mix32_int
from ..distributed import Shard
from ..ops.lomo import grad_accumulate_op
from . import int8_buffer
from .int8_buffer import Int8Buffer
from .rounding import WriteBackRounding, step_value

# A parameter's accumulated gradient: a tensor of the buffer's dtype, or the 8-bit buffer.
Buffer = torch.Tensor | Int8Buffer

# Salt of the accumulation's rounding stream: its bits are independent of the write-back's.
_ACCUMULATION_SALT = 0x5A3C_96E1


def micro_batch_value(seed: int, step_count: int, micro_batch: int) -> int:
    """The per-micro-batch part of the accumulation's rounding key: distinct per (seed, step,
    micro-batch), 31 bits as `rounding.step_value`."""
    mixed = step_value(seed, step_count) ^ mix32_int(micro_batch ^ _ACCUMULATION_SALT)
    return mix32_int(mixed) & 0x7FFFFFFF


def check_accumulation(
    steps: object, dtype: object, single_backward: bool
) -> tuple[int, torch.dtype | None]:
    """The constructor's `accumulation_steps` and `accumulation_dtype`, checked, with what
    accumulation does not combine with refused."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"accumulation_steps must be an int >= 1 (micro-batches per step), got {steps!r}"
        )
    if dtype is not None and dtype not in (*SUPPORTED_DTYPES, torch.int8):
        raise ValueError(
            "accumulation_dtype must be None (the parameter's dtype), torch.float32, "
            "torch.bfloat16, torch.float16 or torch.int8 (8-bit blockwise: int8 codes and "
            f"one scale per 256 elements), got {dtype!r}"
        )
    if steps == 1 and dtype is not None:
        raise ValueError(
            "accumulation_dtype applies to the buffers of accumulation_steps > 1; with one "
            "micro-batch per step there is no buffer: leave it out"
        )
    if steps > 1 and single_backward:
        raise ValueError(
            "single_backward=True with accumulation_steps > 1: the accumulated gradients' norm "
            "is known once the last micro-batch's backward is done, so clipping is exact "
            "with one backward per micro-batch already: leave single_backward out"
        )
    return steps, dtype


class Accumulation:
    """The micro-batches of the step in progress: the buffers, how many micro-batches they
    hold, and per device the step's [sum of squares, inf/nan flag] of the accumulated
    gradients (measured by the last micro-batch's pass)."""

    def __init__(self, steps: int, dtype: torch.dtype | None, rounding: WriteBackRounding):
        self.steps = steps
        self.dtype = dtype
        self.rounding = rounding
        self.pending = 0  # micro-batches accumulated into the buffers
        self.measuring = False  # this micro-batch's pass measures the accumulated gradients
        # id(param) -> (param, buffer, shard), in the order the gradients first arrived. Kept
        # from step to step (a new allocation would be paged in again every step); those
        # written this step are `_written`.
        self._buffers: dict[int, tuple[torch.Tensor, Buffer, Shard | None]] = {}
        self._written: set[int] = set()
        self._measured: dict[torch.device, torch.Tensor] = {}  # [sumsq, found] per device
        self._measured_ids: set[int] = set()  # buffers the measuring pass has summed
        # 8-bit buffers fed in row blocks that cut their blocks: measured whole at the end.
        self._measure_whole: set[int] = set()
        self._seed_steps: dict[torch.device, torch.Tensor] = {}

    def buffer_dtype(self, param: torch.Tensor) -> torch.dtype:
        return param.dtype if self.dtype is None else self.dtype

    def begin_micro_batch(
        self, step_count: int, devices: Iterable[torch.device], measuring: bool
    ) -> None:
        """Before a micro-batch's backward (host-side, no sync): a new step's first clears the
        flags; every one refreshes the rounding's per-micro-batch value."""
        self.measuring = measuring
        value = micro_batch_value(self.rounding.seed, step_count, self.pending)
        for device in devices:
            measured = self._measured.get(device)
            if measured is None:
                measured = self._measured[device] = torch.zeros(2, device=device)
                self._seed_steps[device] = torch.zeros(1, dtype=torch.int64, device=device)
            if self.pending == 0:
                measured.zero_()
            self._seed_steps[device].fill_(value)

    def add(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        seed: int,
        inv_scale: torch.Tensor | None,
        backend: Any,
        shard: Shard | None = None,
    ) -> None:
        """Adds `param`'s gradient of this micro-batch into its buffer (allocated at its first
        gradient of the step); `seed`: the parameter's rounding seed (its index). Sharded,
        `grad` is this rank's reduced slice `shard` of it, and the buffer that slice's: it
        rounds as the whole parameter's buffer would (`WriteBackRounding.in_pieces`)."""
        buffer, first = self._buffer(param, grad, shard, zeroed=False)
        if self.measuring:
            self._measured_ids.add(id(param))
        if isinstance(buffer, Int8Buffer):
            self._add_int8(buffer, grad, 0, first, self.measuring, seed, inv_scale, backend)
            return
        offset = 0 if shard is None else shard.offset
        self._add(buffer, grad, first, offset, seed, inv_scale, backend)

    def add_rows(
        self,
        param: torch.Tensor,
        start: int,
        stop: int,
        grad: torch.Tensor,
        seed: int,
        inv_scale: torch.Tensor | None,
        backend: Any,
    ) -> None:
        """`add` for rows [start, stop) of `param`, from their gradient `grad` (a fused op's
        block, `AccumulatedRows`): the buffer starts at zero, as the blocks may skip rows."""
        buffer, _ = self._buffer(param, param, None, zeroed=True)
        width = param.numel() // param.shape[0] if param.shape[0] else 0
        if isinstance(buffer, Int8Buffer):
            self._add_int8_rows(param, buffer, start * width, grad, seed, inv_scale, backend)
            return
        if self.measuring:
            self._measured_ids.add(id(param))
        self._add(buffer[start:stop], grad, False, start * width, seed, inv_scale, backend)

    def _add_int8_rows(
        self,
        param: torch.Tensor,
        buffer: Int8Buffer,
        start: int,
        grad: torch.Tensor,
        seed: int,
        inv_scale: torch.Tensor | None,
        backend: Any,
    ) -> None:
        """`add_rows` into an 8-bit buffer, from flat element `start`. Every block but the
        last has the same rows, and the measuring micro-batch hands them over in order, so
        the first block says whether the blocks cut the buffer's 256-element blocks; if they
        do, none measures and the buffer is measured whole by `measure_rest`."""
        key = id(param)
        measuring = self.measuring and key not in self._measure_whole
        if measuring and start == 0 and not buffer.covers_whole_blocks(0, grad.numel()):
            self._measure_whole.add(key)
            measuring = False
        measured = self._add_int8(buffer, grad, start, False, measuring, seed, inv_scale, backend)
        if not measured:
            raise AssertionError("a row block cut the 8-bit buffer's blocks unannounced")
        if measuring:
            self._measured_ids.add(key)

    def _add_int8(
        self,
        buffer: Int8Buffer,
        grad: torch.Tensor,
        start: int,
        first: bool,
        measuring: bool,
        seed: int,
        inv_scale: torch.Tensor | None,
        backend: Any,
    ) -> bool:
        """One fused accumulate pass into an 8-bit buffer (`int8_buffer.add`); returns
        whether it measured what was asked."""
        if not grad.numel():
            return True
        measured = self._measured[buffer.device]
        stochastic = self.rounding.stochastic
        rounding = (stochastic, seed, self._seed_steps[buffer.device] if stochastic else None)
        sumsq = measured[0:1] if measuring else None
        return int8_buffer.add(
            buffer, grad, start, first, (sumsq, measured[1:2]), rounding, inv_scale, backend
        )

    def _buffer(
        self, param: torch.Tensor, like: torch.Tensor, shard: Shard | None, zeroed: bool
    ) -> tuple[Buffer, bool]:
        """`param`'s buffer, shaped like `like`, and whether this is its first gradient of the
        step, which then overwrites it (`zeroed`: the buffer is zeroed instead, for a
        gradient that comes in blocks which may leave rows out)."""
        entry = self._buffers.get(id(param))
        if entry is not None and id(param) in self._written:
            return entry[1], False
        if entry is None:
            buffer = self._new_buffer(param, like, shard, zeroed)
            self._buffers[id(param)] = (param, buffer, shard)
        else:
            buffer = entry[1]
            if zeroed:
                buffer.zero_()
        self._written.add(id(param))
        return buffer, not zeroed

    def _new_buffer(
        self, param: torch.Tensor, like: torch.Tensor, shard: Shard | None, zeroed: bool
    ) -> Buffer:
        if self.dtype == torch.int8:
            return Int8Buffer.like(like, 0 if shard is None else shard.offset, zeroed)
        make = torch.zeros_like if zeroed else torch.empty_like
        return make(like, dtype=self.buffer_dtype(param))

    def _add(
        self,
        buffer: torch.Tensor,
        grad: torch.Tensor,
        first: bool,
        offset: int,
        seed: int,
        inv_scale: torch.Tensor | None,
        backend: Any,
    ) -> None:
        """One fused accumulate pass of `grad` into `buffer`, which starts at flat `offset` of
        its parameter: stochastically rounded buffers in aligned pieces, each with the seed
        under which it rounds as the whole parameter's buffer would."""
        if not buffer.numel():
            return
        device = buffer.device
        measured = self._measured[device]
        stochastic = self.rounding.applies_to(buffer.dtype)
        seed_step = self._seed_steps[device] if stochastic else None
        flat, flat_grad = buffer.reshape(-1), grad.reshape(-1)

        def piece(a: int, b: int, piece_seed: int) -> None:
            whole = a == 0 and b == flat.numel()
            # In the op's order (GRAD_ACCUMULATE.names); every value is the optimizer's own
            # and in the op's form, so the public function's per-call conversions are skipped.
            grad_accumulate_op.call_in_order(
                backend,
                (
                    buffer if whole else flat[a:b],  # buffer
                    (grad if whole else flat_grad[a:b]).contiguous(),  # grad
                    first,  # first
                    inv_scale,  # inv_scale
                    measured[0:1] if self.measuring else None,  # sumsq
                    measured[1:2],  # found_inf: every micro-batch (a buffer may get no more)
                    stochastic,  # stochastic_rounding
                    piece_seed if stochastic else 0,  # seed
                    seed_step,  # seed_step
                ),
            )

        if stochastic:
            self.rounding.in_pieces(seed, offset, flat.numel(), piece)
        else:
            piece(0, flat.numel(), 0)

    def measure_rest(self, inv_scale_for: Any, backend: str | None) -> None:
        """Measures the buffers the last micro-batch's pass did not reach (a parameter without
        a gradient there, or every buffer of a step applied early by `step()`), so the step's
        norm and flag cover every accumulated gradient. `inv_scale_for(device)`: the loss
        scale's inverse there."""
        for param, buffer, _ in self.buffered():
            if id(param) in self._measured_ids or not buffer.numel():
                continue
            measured = self._measured[buffer.device]
            if isinstance(buffer, Int8Buffer):
                int8_buffer.measure_sumsq(
                    buffer, measured[0:1], measured[1:2], inv_scale_for(buffer.device), backend
                )
                self._measured_ids.add(id(param))
                continue
            ops.grad_sumsq_(
                buffer,
                measured[0:1],
                inv_scale=inv_scale_for(buffer.device),
                found_inf=measured[1:2],
                backend=backend,
            )
            self._measured_ids.add(id(param))

    def buffered(self) -> list[tuple[torch.Tensor, Buffer, Shard | None]]:
        """(parameter, buffer, this rank's shard or None) of every parameter that got a
        gradient this step, in the order the gradients first arrived (the same on every
        rank: the sharding hands the slices over in the same order)."""
        return [entry for key, entry in self._buffers.items() if key in self._written]

    def measured(self, device: torch.device) -> torch.Tensor:
        """[sum of squares, inf/nan flag] of the accumulated gradients on `device`."""
        return self._measured[device]

    def devices(self) -> list[torch.device]:
        return list(self._measured)

    def release(self, free: bool = False) -> None:
        """Ends the step's accumulation (after a step, or `zero_grad`): nothing is pending;
        the buffers are kept for the next step unless `free`."""
        self._written.clear()
        self._measured_ids.clear()
        self._measure_whole.clear()
        self.pending = 0
        self.measuring = False
        if free:
            self._buffers.clear()

    def buffer_bytes(self) -> int:
        """The bytes the buffers of this step hold now."""
        return sum(
            b.nbytes() if isinstance(b, Int8Buffer) else b.numel() * b.element_size()
            for _, b, _ in self._buffers.values()
        )


class AccumulatedRows:
    """A `core.gradient_sink.GradientSink` adding a fused op's row blocks of a weight's
    gradient (the logits-free head's vocabulary chunks) into the weight's buffer, so that
    the whole ``vocab x hidden`` gradient never exists in a micro-batch either. The
    measuring micro-batch takes every block (zero ones too), so the sum of squares covers
    every row of the buffer."""

    measure_first = False
    measuring = False

    def __init__(
        self,
        accumulation: Accumulation,
        param: torch.Tensor,
        seed: int,
        inv_scale: torch.Tensor | None,
        backend: Any,
    ) -> None:
        self._accumulation = accumulation
        self._param = param
        self._seed = seed
        self._inv_scale = inv_scale
        self._backend = backend
        self.changes_zero_rows = accumulation.measuring

    def measure(self, start: int, stop: int, grad: torch.Tensor) -> None:
        raise AssertionError("AccumulatedRows never asks for a measuring sweep")

    def measured(self) -> None:
        raise AssertionError("AccumulatedRows never asks for a measuring sweep")

    def apply(self, start: int, stop: int, grad: torch.Tensor) -> None:
        self._accumulation.add_rows(
            self._param, start, stop, grad, self._seed, self._inv_scale, self._backend
        )

    def finish(self) -> None:
        return None
