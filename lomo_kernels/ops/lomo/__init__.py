"""The fused LOMO ops: their specs (one per op, `spec.py`) and public functions.

    fused_lomo_update_    one LOMO step on one parameter, one pass over memory
                          (op ``lomo_kernels::lomo_update_``; also ``fused_sgd_update_``)
    grad_sumsq_           sum of squares of a (scaled) gradient + inf/nan flag, one pass
                          (op ``lomo_kernels::grad_sumsq_``)
    grad_accumulate_      a micro-batch's gradient added into its accumulation buffer, with
                          the result's sum of squares + inf/nan flag, one pass
                          (op ``lomo_kernels::grad_accumulate_``)
    grad_accumulate_int8_ the same into an 8-bit blockwise buffer (int8 codes, a power-of-two
                          scale per block: `core/int8_blocks.py`), one pass
    lomo_update_int8_     one LOMO step whose gradient is read from such a buffer, one pass
    int8_dequantize_      such a buffer's values into a float tensor, one pass
    clip_coef_from_sumsq  device-side clip-by-norm coefficient

The public functions check their arguments and convert runtime scalars to device tensors
once (by the spec: `OpSpec.convert`); the ops take them only as tensors. Kernels per device:
`backends.py`.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ...core.checks import check_finite, check_pair
from ...core.int8_blocks import blocks_of
from ...core.rounding import check_stochastic_rounding
from ...core.scalars import Scalar
from ..backends import LOMO
from ..definition import define
from .spec import (
    GRAD_ACCUMULATE,
    GRAD_ACCUMULATE_INT8,
    GRAD_SUMSQ,
    INT8_DEQUANTIZE,
    LOMO_UPDATE,
    LOMO_UPDATE_INT8,
    SPECS,  # noqa: F401  (the family's ops, for the backends' checks)
)

# The ops as the public functions call them: ``op(backend, **arguments)`` (eager.py).
lomo_update_op = define(LOMO_UPDATE, LOMO)
grad_sumsq_op = define(GRAD_SUMSQ, LOMO)
grad_accumulate_op = define(GRAD_ACCUMULATE, LOMO)
grad_accumulate_int8_op = define(GRAD_ACCUMULATE_INT8, LOMO)
lomo_update_int8_op = define(LOMO_UPDATE_INT8, LOMO)
int8_dequantize_op = define(INT8_DEQUANTIZE, LOMO)


def fused_lomo_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: Scalar,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    clip_coef: Scalar | None = None,
    weight_decay: float = 0.0,
    found_inf: torch.Tensor | None = None,
    skip_if: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    offset: int = 0,
    backend: str | ModuleType | None = None,
) -> None:
    """Applies one LOMO step to `param` in place, reading `grad` and `param` once.

    In fp32: ``g = grad * inv_scale``; an element whose ``g`` is inf/nan keeps its parameter
    value and sets ``found_inf``; ``g = clamp(g, -clip_value, clip_value)``;
    ``g *= clip_coef``; ``param = param * (1 - lr * weight_decay) - lr * g``, written back in
    the parameter's dtype (bf16/fp16 round to nearest even, or stochastically with
    ``stochastic_rounding=True``: unbiased, reproducible from ``seed`` and the element index;
    `_rounding.round_to_dtype`).

    ``seed_step`` (optional, a 1-element int64 tensor on the parameter's device) is the
    per-step part of the rounding seed, read by the kernel: its low 32 bits are XORed into
    the high 32 bits of ``seed``. A training loop keeps ``seed`` fixed per parameter and
    refreshes ``seed_step`` in place each step, so a compiled graph never depends on the step.
    ``offset``: where `param` is a slice (a shard, a block of rows) of a larger parameter, the
    flat index of its element 0 in that parameter; the rounding draws the bits of the flat
    indices ``offset + j``, so the slice rounds exactly as the whole parameter would.

    ``found_inf`` (1-element fp32) is only ever raised to 1. When ``skip_if`` is given and
    non-zero on entry the op writes nothing: pass the flag a detection pass filled. If
    ``skip_if`` is omitted, ``found_inf``'s own value on entry acts as the skip flag.

    ``backend``: 'triton', 'cpp', 'torch' or None (automatic), or the module
    `ops.backends.resolve` returned, for a caller making many calls (resolved once).
    """
    public = locals()  # the arguments, by name
    check_pair(param, grad)
    check_stochastic_rounding(param, stochastic_rounding, "parameter")
    # Without an explicit skip flag, found_inf's value on entry decides (GradScaler pattern).
    skip = found_inf if skip_if is None else skip_if
    arguments = LOMO_UPDATE.take(public, grad=grad.contiguous(), skip_if=skip)
    arguments = LOMO_UPDATE.convert(param.device, arguments)
    check_slice_end(arguments["offset"], param)
    if param.numel():
        lomo_update_op(backend, **arguments)


fused_sgd_update_ = fused_lomo_update_


def grad_sumsq_(
    grad: torch.Tensor,
    sumsq: torch.Tensor,
    *,
    inv_scale: Scalar | None = 1.0,
    found_inf: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """``sumsq += sum((fp32(grad) * inv_scale) ** 2)``; raises ``found_inf`` to 1 on inf/nan.

    One pass over ``grad``; ``sumsq`` and ``found_inf`` are 1-element fp32 device tensors.
    """
    check_pair(grad, grad)
    arguments = {"grad": grad.contiguous(), "inv_scale": inv_scale, "sumsq": sumsq}
    arguments = GRAD_SUMSQ.convert(grad.device, {**arguments, "found_inf": found_inf})
    if grad.numel():
        grad_sumsq_op(backend, **arguments)


def grad_accumulate_(
    buffer: torch.Tensor,
    grad: torch.Tensor,
    *,
    first: bool = False,
    inv_scale: Scalar | None = 1.0,
    sumsq: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    offset: int = 0,
    backend: str | ModuleType | None = None,
) -> None:
    """Adds one micro-batch's gradient into its accumulation buffer in place, in one pass.

    In fp32: ``new = buffer + grad`` (``first=True``: ``new = grad``, the buffer's old contents
    are not read, so it may be uninitialised), stored in the buffer's dtype: fp32 exactly,
    bf16/fp16 to nearest even or stochastically (``stochastic_rounding``, keyed by ``seed``,
    ``seed_step`` and the element's flat index ``offset + j`` as `fused_lomo_update_`'s
    write-back: a buffer for a slice of a parameter rounds as the whole one's would). With
    ``sumsq`` (1-element fp32), ``sumsq += sum((stored * inv_scale) ** 2)``: the norm of what
    an update reading the buffer with that ``inv_scale`` sees. ``found_inf`` is raised to 1
    when a stored value times ``inv_scale`` is inf/nan; given alone, the CPU kernels track
    only the largest stored magnitude for it, a cheaper pass than the squares (what the
    micro-batches before a step's measuring one run). The buffer holds the loss-scaled sum
    (as ``.grad`` does under torch's GradScaler): ``inv_scale`` unscales only the
    measurement.
    """
    public = locals()  # the arguments, by name
    check_pair(buffer, grad)
    check_stochastic_rounding(buffer, stochastic_rounding, "buffer")
    arguments = GRAD_ACCUMULATE.take(public, grad=grad.contiguous())
    arguments = GRAD_ACCUMULATE.convert(buffer.device, arguments)
    check_slice_end(arguments["offset"], buffer)
    if buffer.numel():
        grad_accumulate_op(backend, **arguments)


def check_slice_end(offset: int, like: torch.Tensor) -> None:
    """A slice of `like`'s elements at flat `offset` (checked by the spec) of its parameter
    ends below 2**63: every backend indexes offset + j and the end in int64."""
    # At offset 0 no tensor reaches 2**63 (and a tracer holds numel as a value of its own).
    if offset and offset + like.numel() >= 2**63:
        raise ValueError(
            f"lomo_kernels: {like.numel()} elements at offset {offset} end past 2**63 - 1: a "
            "slice's flat indices in its parameter must be int64s"
        )


def check_int8_buffer(
    codes: torch.Tensor, scales: torch.Tensor, offset: int, like: torch.Tensor
) -> None:
    """An 8-bit blockwise buffer (`core/int8_blocks.py`) of `like`'s elements starting at flat
    `offset` (checked by the spec) of its parameter: contiguous int8 codes of like's numel,
    contiguous fp32 scales, one per block it touches, all on like's device."""
    if codes.dtype != torch.int8 or scales.dtype != torch.float32:
        raise TypeError(
            "lomo_kernels: an 8-bit buffer is int8 codes and float32 scales, got "
            f"{codes.dtype} and {scales.dtype}"
        )
    for name, t in (("codes", codes), ("scales", scales)):
        if t.device != like.device:
            raise ValueError(f"lomo_kernels: {name} is on {t.device}, the data on {like.device}")
        if not t.is_contiguous():
            raise ValueError(f"lomo_kernels: {name} must be contiguous")
    if codes.numel() != like.numel():
        raise ValueError(
            f"lomo_kernels: codes has {codes.numel()} elements, the data {like.numel()}"
        )
    check_slice_end(offset, like)
    blocks = blocks_of(offset, like.numel())
    if scales.numel() != blocks:
        raise ValueError(
            f"lomo_kernels: {like.numel()} elements at offset {offset} touch {blocks} blocks: "
            f"scales must have {blocks} elements, got {scales.numel()} (core.int8_blocks.blocks_of)"
        )


def grad_accumulate_int8_(
    codes: torch.Tensor,
    scales: torch.Tensor,
    grad: torch.Tensor,
    *,
    offset: int = 0,
    first: bool = False,
    inv_scale: Scalar | None = 1.0,
    sumsq: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    backend: str | ModuleType | None = None,
) -> None:
    """`grad_accumulate_` into an 8-bit blockwise buffer (`core/int8_blocks.py`), in one pass.

    ``new = codes * scales + grad`` (``first``: ``new = grad``, codes and scales not read);
    each block stores the power-of-two scale of its largest ``|new|`` and each element its
    code, rounded to nearest even or stochastically (keyed by ``seed``, ``seed_step`` and the
    flat index ``offset + j`` in the whole parameter, so a slice rounds as the whole would).
    ``sumsq`` and ``found_inf`` as `grad_accumulate_`, of the stored values.
    """
    public = locals()  # the arguments, by name
    check_pair(grad, grad)
    arguments = GRAD_ACCUMULATE_INT8.take(public, grad=grad.contiguous())
    arguments = GRAD_ACCUMULATE_INT8.convert(grad.device, arguments)
    check_int8_buffer(codes, scales, arguments["offset"], grad)
    if grad.numel():
        grad_accumulate_int8_op(backend, **arguments)


def lomo_update_int8_(
    param: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    offset: int = 0,
    lr: Scalar,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    clip_coef: Scalar | None = None,
    weight_decay: float = 0.0,
    found_inf: torch.Tensor | None = None,
    skip_if: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    backend: str | ModuleType | None = None,
) -> None:
    """`fused_lomo_update_` with the gradient ``codes * scales`` read from an 8-bit blockwise
    buffer, in one pass; `param` is the slice at flat `offset` of its parameter (0: the whole
    parameter), whose stochastic write-back draws the whole parameter's bits."""
    public = locals()  # the arguments, by name
    check_pair(param, param)
    check_stochastic_rounding(param, stochastic_rounding, "parameter")
    skip = found_inf if skip_if is None else skip_if
    arguments = LOMO_UPDATE_INT8.convert(param.device, LOMO_UPDATE_INT8.take(public, skip_if=skip))
    check_int8_buffer(codes, scales, arguments["offset"], param)
    if param.numel():
        lomo_update_int8_op(backend, **arguments)


def int8_dequantize_(
    out: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    offset: int = 0,
    backend: str | ModuleType | None = None,
) -> None:
    """``out = codes * scales`` in out's dtype (exact in fp32 and bf16), in one pass."""
    public = locals()  # the arguments, by name
    check_pair(out, out)
    arguments = INT8_DEQUANTIZE.convert(out.device, INT8_DEQUANTIZE.take(public))
    check_int8_buffer(codes, scales, arguments["offset"], out)
    if out.numel():
        int8_dequantize_op(backend, **arguments)


def clip_coef_from_sumsq(sumsq: torch.Tensor, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """``min(1, max_norm / (sqrt(sumsq) + eps))`` as a 1-element device tensor (no host sync)."""
    check_finite("max_norm", max_norm, positive=True)
    return torch.clamp(max_norm / (sumsq.sqrt() + eps), max=1.0)
