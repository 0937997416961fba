"""Gradient accumulation over micro-batches: one buffer per trainable parameter, and the step
applied from the buffers once the last micro-batch's gradients are in.

Each ``fused_backward(loss)`` of an optimizer built with ``accumulation_steps=k`` is one
micro-batch. Its backward adds every gradient into the parameter's buffer with one fused pass
(`ops.grad_accumulate_`) and frees it at once, so no ``.grad`` is ever kept; the buffer is
allocated at the parameter's first gradient of the step, in the parameter's dtype (bf16 and
fp16 rounded stochastically by default, as the write-back is) or in ``accumulation_dtype``
(``torch.int8``: the 8-bit blockwise buffer, `int8_buffer.py`).
Every micro-batch's pass raises the inf/nan flag of what it stores (the flag alone is a
cheaper pass than the squares); the k-th also measures the accumulated gradients' squared
norm, so the step then knows the exact global norm without a norm pass: every
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

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..core.checks import SUPPORTED_DTYPES
from ..core.rounding import mix32_int
from ..distributed import Shard
from ..ops.lomo import grad_accumulate_op
from . import int8_buffer
from .device_scalars import DeviceScalars
from .int8_buffer import Int8Buffer
from .loss_scaling import LossScaling
from .piece import Piece
from .rounding import WriteBackRounding, fill_per_device, parameter_seed, step_value

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
    """The micro-batches of the step in progress: the buffers and how many micro-batches
    they hold. The last micro-batch's pass measures the accumulated gradients into the
    device scalars' norm-pass sums (`DeviceScalars.sumsq`, `norm_found_inf`), where the
    step reads them as it reads a norm pass's."""

    def __init__(self, steps: int, dtype: torch.dtype | None, rounding: WriteBackRounding):
        self.steps = steps
        self.dtype = dtype
        self.rounding = rounding
        self.pending = 0  # micro-batches accumulated into the buffers
        self.measuring = False  # this micro-batch's pass measures the accumulated gradients
        self.added = False  # this micro-batch's pass has reached the buffers
        # Per buffer, this micro-batch's rounding: the end of what its current part of the
        # gradient rounded, and how many parts came before it (`_begins_part`).
        self._rounded_until: dict[int, int] = {}
        self._parts: dict[int, int] = {}
        # id(param) -> (param, buffer, shard), in the order the gradients first arrived. Kept
        # from step to step (a new allocation would be paged in again every step); those
        # written this step are `_written`.
        self._buffers: dict[int, tuple[torch.Tensor, Buffer, Shard | None]] = {}
        self._written: set[int] = set()
        self._measured: set[int] = set()  # buffers the measuring pass has summed
        # Buffers the measuring pass must not sum piece by piece (they get more than one
        # contribution, or 8-bit blocks cut by row blocks): measured whole by `measure_rest`.
        self._measure_whole: set[int] = set()
        self._seed_steps: dict[torch.device, torch.Tensor] = {}
        self._scale_setting: object = None  # the loss scale the pending micro-batches took

    def waiting(self) -> str:
        """The pending micro-batches, for messages: a loop may carry a step past k."""
        noun = "micro-batch" if self.pending == 1 else "micro-batches"
        return f"{self.pending} {noun} accumulated and not applied (a step is {self.steps})"

    def check_scale(self, scaling: LossScaling) -> None:
        """Notes the loss scale set when no micro-batch is pending; refuses, before any change,
        a scale set anew while some are: the buffers hold gradients scaled by the one the
        step's first micro-batch took, and the step divides them by the scale then set."""
        if not self.pending:
            self._scale_setting = scaling.setting()
        elif scaling.scale_changed_since(self._scale_setting):
            raise RuntimeError(
                f"{scaling.setting_name} was set with {self.waiting()}: their buffers "
                "hold gradients scaled by the "
                "scale of the step's first micro-batch, which the step would divide by the new "
                "one. Set the loss scale between steps (after a step's last micro-batch, "
                "opt.step() or opt.zero_grad()), or set it back. Nothing was changed."
            )

    def begin_micro_batch(
        self,
        step_count: int,
        devices: Iterable[torch.device],
        measuring: bool,
        measure_whole: Iterable[torch.Tensor] = (),
    ) -> None:
        """Before a micro-batch's backward (host-side, no sync): refreshes the rounding's
        per-micro-batch value. `measuring`: the pass measures the accumulated gradients,
        except those of `measure_whole` (parameters whose gradient arrives in more than one
        contribution: the loss's graph says which), measured whole at the step."""
        self.measuring = measuring
        self.added = False
        self._rounded_until.clear()
        self._parts.clear()
        self._measure_whole = {id(p) for p in measure_whole} if measuring else set()
        value = micro_batch_value(self.rounding.seed, step_count, self.pending)
        fill_per_device(self._seed_steps, devices, value)

    def add(self, piece: Piece, index: int, inv_scale: torch.Tensor | None, backend: Any) -> None:
        """Adds a micro-batch's gradient of `piece` (a whole parameter, this rank's reduced
        slice of it or a block of its rows) into the parameter's buffer with one fused pass;
        `index`: the parameter's index among the trained ones (its rounding seed, and its slot
        of the per-parameter sums, `DeviceScalars.slot_sum`). The buffer is this rank's part
        of the parameter and rounds as the whole parameter's would
        (the ops draw the bits of each element's flat index in it); a piece that covers only
        part of it (row blocks, which may skip rows) adds into a buffer zeroed at its first
        piece of the step."""
        self.added = True
        key = id(piece.param)
        grad = piece.grad
        # The piece's place in the buffer, which is this rank's part of the parameter (its
        # slice, from the shard's flat offset, or the whole tensor), and whether it covers it.
        shard = piece.shard
        like = piece.param if shard is None else shard.local
        start = piece.offset - (0 if shard is None else shard.offset)
        stop = start + grad.numel()
        covers = start == 0 and stop == like.numel()
        buffer, first = self._buffer(piece, like, covers)
        measuring = self.measuring and key not in self._measure_whole
        cuts_blocks = isinstance(buffer, Int8Buffer) and not buffer.covers_whole_blocks(start, stop)
        new_part = grad.numel() > 0 and self._begins_part(key, buffer, start, stop)
        scalars = piece.scalars
        measured = key in self._measured
        # Rows a new part of the gradient brings: a second contribution the loss's graph did
        # not show (a tied weight whose other use is inside a reentrant checkpoint). Their sum
        # is measured whole at the step instead, the partial sums dropped.
        if measuring and (cuts_blocks or (new_part and not covers)):
            # Row blocks that cut the 8-bit blocks are re-rounded whole: measured at the end.
            if measured:
                scalars.slot_sum(index, anew=True)
                self._measured.discard(key)
            self._measure_whole.add(key)
            measuring = False
        sumsq = None
        if measuring:
            # A second part of the gradient (reentrant checkpoint segments each deliver one)
            # covers the buffer again: its slot measures the whole sum anew.
            sumsq = scalars.slot_sum(index, anew=covers and measured)
            self._measured.add(key)
        if not grad.numel():
            return
        seed = parameter_seed(index, self._parts.get(key, 0))
        # found_inf every micro-batch: a buffer may get no more gradients.
        if isinstance(buffer, Int8Buffer):
            stochastic = self.rounding.stochastic
            seed_step = self._seed_steps[buffer.device] if stochastic else None
            int8_buffer.add(buffer, grad, start, first, (sumsq, scalars.norm_found_inf),
                            (stochastic, seed, seed_step), inv_scale, backend)  # fmt: skip
            return
        part = buffer.view(-1)[start:stop]
        self._add(part, grad, first, piece.offset, seed, inv_scale, backend,
                  (sumsq, scalars.norm_found_inf))  # fmt: skip

    def _begins_part(self, key: int, buffer: Buffer, start: int, stop: int) -> bool:
        """Whether an add into elements [start, stop) of `key`'s buffer rounds again what an
        earlier add of this micro-batch rounded: a new part of the gradient (a second use's,
        a row block re-rounding an 8-bit block the previous one cut), counted in `_parts`.
        The first part rounds with the parameter's seed, as the whole parameter's buffer
        rounds; each later one with bits of its own (`parameter_seed`): re-rounded with the
        same bits, a value whose block's scale grew in between would keep the first
        rounding's direction (biased)."""
        if isinstance(buffer, Int8Buffer):  # an add re-rounds the whole blocks it touches
            start, stop = buffer.block_bounds(start, stop)
        until = self._rounded_until.get(key, 0)
        begins = start < until
        if begins:
            self._parts[key] = self._parts.get(key, 0) + 1
            until = 0
        self._rounded_until[key] = max(stop, until)
        return begins

    def _buffer(self, piece: Piece, like: torch.Tensor, covers: bool) -> tuple[Buffer, bool]:
        """`piece`'s parameter's buffer (this rank's part of it, shaped like `like`) and
        whether the piece is its first gradient of the step and `covers` it whole (it then
        overwrites it)."""
        key = id(piece.param)
        entry = self._buffers.get(key)
        if entry is not None and key in self._written:
            return entry[1], False
        if entry is None:
            buffer = self._new_buffer(piece.param, like, piece.shard, zeroed=not covers)
            self._buffers[key] = (piece.param, buffer, piece.shard)
        else:
            buffer = entry[1]
            if not covers:
                buffer.zero_()
        self._written.add(key)
        return buffer, covers

    def _new_buffer(
        self, param: torch.Tensor, like: torch.Tensor, shard: Shard | None, zeroed: bool
    ) -> Buffer:
        if self.dtype == torch.int8:
            return Int8Buffer.like(like, 0 if shard is None else shard.offset, zeroed)
        make = torch.zeros_like if zeroed else torch.empty_like
        return make(like, dtype=param.dtype if self.dtype is None else self.dtype)

    def _add(
        self,
        buffer: torch.Tensor,
        grad: torch.Tensor,
        first: bool,
        offset: int,
        seed: int,
        inv_scale: torch.Tensor | None,
        backend: Any,
        measure: tuple[torch.Tensor | None, torch.Tensor],
    ) -> None:
        """One fused accumulate pass of `grad` into the flat `buffer`, which starts at flat
        `offset` of its parameter: a stochastically rounded buffer draws the bits of its
        elements' flat indices, so it rounds as the whole parameter's buffer would.
        `measure`: (sumsq, or None not to measure; found_inf)."""
        stochastic = self.rounding.applies_to(buffer.dtype)
        # In the op's order (GRAD_ACCUMULATE.names); every value is the optimizer's own and in
        # the op's form, so the public function's per-call conversions are skipped.
        grad_accumulate_op.call_in_order(
            backend,
            (
                buffer,  # buffer
                grad.reshape(-1).contiguous(),  # grad
                first,  # first
                inv_scale,  # inv_scale
                *measure,  # sumsq, found_inf
                stochastic,  # stochastic_rounding
                seed if stochastic else 0,  # seed
                self._seed_steps[buffer.device] if stochastic else None,  # seed_step
                offset,  # offset
            ),
        )

    def measure_rest(
        self,
        scalars_for: Callable[[torch.device], DeviceScalars],
        index_of: Callable[[torch.Tensor], int],
        inv_scale_for: Callable[[torch.device], torch.Tensor | None],
        backend: str | None,
    ) -> None:
        """Measures the buffers the last micro-batch's pass did not (a parameter without a
        gradient there, one measured whole, or every buffer of a step applied early by
        `step()`), each into its parameter's slot (`index_of`), so the step's norms and flag
        cover every accumulated gradient."""
        for param, buffer, _ in self.buffered():
            if id(param) in self._measured or not buffer.numel():
                continue
            scalars, inv_scale = scalars_for(buffer.device), inv_scale_for(buffer.device)
            if isinstance(buffer, Int8Buffer):
                sumsq = scalars.slot_sum(index_of(param))
                int8_buffer.measure_sumsq(buffer, sumsq, scalars.norm_found_inf, inv_scale, backend)
            else:
                scalars.measure(buffer, index_of(param), inv_scale, backend)
            self._measured.add(id(param))

    def buffered(self) -> list[tuple[torch.Tensor, Buffer, Shard | None]]:
        """(parameter, buffer, this rank's shard or None) of every parameter that got a
        gradient this step, in the order the gradients first arrived (the same on every
        rank: the sharding hands the slices over in the same order)."""
        return [entry for key, entry in self._buffers.items() if key in self._written]

    def batches(self, numel: int | None) -> Iterator[list[tuple[torch.Tensor, Buffer, Shard]]]:
        """`buffered()` under sharding, cut into runs of whole parameters of at most `numel`
        elements together (None: one run; a larger parameter: a run of its own), by the
        parameters' full sizes: the same runs on every rank."""
        run: list[tuple[torch.Tensor, Buffer, Shard]] = []
        size = 0
        for entry in self.buffered():
            full = entry[2].full_numel
            if run and numel is not None and size + full > numel:
                yield run
                run, size = [], 0
            run.append(entry)
            size += full
        if run:
            yield run

    def release(self, free: bool = False) -> None:
        """Ends the step's accumulation (after a step, or `zero_grad`): nothing is pending;
        the buffers are kept for the next step unless `free`."""
        self._written.clear()
        self._measured.clear()
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
