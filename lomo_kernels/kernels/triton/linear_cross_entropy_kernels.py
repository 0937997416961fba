"""Fused linear + cross-entropy: the Triton device code (launchers:
`ops/cross_entropy/triton_backend.py`).

Logit tiles ``[BLOCK_T tokens x BLOCK_V vocabulary rows]`` are built with ``tl.dot`` over the
hidden width in ``BLOCK_K`` steps, in fp32 accumulators, and never leave the program. The
forward walks the whole vocabulary per token tile with an online log-sum-exp. The backward
recomputes one tile per program from the saved log-sum-exp and adds its products into fp32
``d_hidden`` and weight-gradient buffers with atomic adds. Each tile of logits is divided by
the temperature as soon as it is built (the backward's tile gradient then carries its
``1 / temperature``).

On the GPU the inputs are loaded in their own dtype and multiplied by the tensor cores (fp32
inputs in IEEE fp32, no TF32); under the interpreter bf16 travels as int16 bits and is
widened to fp32 first (`NATIVE` false).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.torch_internals import triton_reduce_combines
from .runtime import interpret_mode, kernels

# Builtin reductions, usable whichever mode triton was imported in (see lomo_kernels.py).
_MAX, _SUM = triton_reduce_combines()

DECORATED_FOR_INTERPRETER = interpret_mode()
# The shared widening to fp32, decorated for the same mode as this module.
_shared = kernels("rounding_kernels")
_FP32, _to_fp32 = _shared.FP32, _shared.to_fp32


@triton.jit
def _operand(raw, KIND: tl.constexpr, NATIVE: tl.constexpr):
    """A loaded tile as a tl.dot operand: as stored on the GPU, fp32 under the interpreter."""
    if NATIVE:
        return raw
    else:
        return _to_fp32(raw, KIND)


@triton.jit
def _dot(a, b, KIND: tl.constexpr, NATIVE: tl.constexpr):
    if NATIVE and KIND == _FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _logit_tile(
    hidden_ptr, weight_ptr, offs_t, offs_v, n_tokens, n_vocab, width,
    stride_h, stride_w,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    KIND: tl.constexpr, NATIVE: tl.constexpr,
):  # fmt: skip
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(
            hidden_ptr + offs_t[:, None] * stride_h + offs_k[None, :],
            mask=(offs_t[:, None] < n_tokens) & (offs_k[None, :] < width),
            other=0,
        )
        w = tl.load(
            weight_ptr + offs_v[:, None] * stride_w + offs_k[None, :],
            mask=(offs_v[:, None] < n_vocab) & (offs_k[None, :] < width),
            other=0,
        )
        acc += _dot(_operand(h, KIND, NATIVE), tl.trans(_operand(w, KIND, NATIVE)), KIND, NATIVE)
    return acc


@triton.jit
def forward_kernel(
    hidden_ptr, weight_ptr, labels_ptr, loss_ptr, lse_ptr,
    n_tokens, n_vocab, width, stride_h, stride_w, ignore_index, temperature,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    KIND: tl.constexpr, NATIVE: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    labels = tl.load(labels_ptr + offs_t, mask=offs_t < n_tokens, other=ignore_index)
    running_max = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    target = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for v0 in range(0, n_vocab, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        logits = _logit_tile(
            hidden_ptr, weight_ptr, offs_t, offs_v, n_tokens, n_vocab, width, stride_h,
            stride_w, BLOCK_T, BLOCK_V, BLOCK_K, KIND, NATIVE,
        )  # fmt: skip
        logits = tl.where(offs_v[None, :] < n_vocab, logits / temperature, float("-inf"))
        new_max = tl.maximum(running_max, tl.reduce(logits, 1, _MAX))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.reduce(
            tl.exp(logits - new_max[:, None]), 1, _SUM
        )
        running_max = new_max
        hit = offs_v[None, :] == labels[:, None]
        target += tl.reduce(tl.where(hit, logits, 0.0), 1, _SUM)
    lse = running_max + tl.log(running_sum)
    in_range = offs_t < n_tokens
    tl.store(lse_ptr + offs_t, lse, mask=in_range)
    tl.store(loss_ptr + offs_t, tl.where(labels != ignore_index, lse - target, 0.0), mask=in_range)


@triton.jit
def backward_kernel(
    grad_ptr, hidden_ptr, weight_ptr, labels_ptr, lse_ptr, d_hidden_ptr, d_weight_ptr,
    n_tokens, n_vocab, width, vocab_start, stride_h, stride_w, temperature,
    WITH_D_HIDDEN: tl.constexpr, WITH_D_WEIGHT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    KIND: tl.constexpr, NATIVE: tl.constexpr,
):  # fmt: skip
    """One (token tile, vocabulary tile) of a chunk: ``weight_ptr`` points at the chunk's
    first row, ``n_vocab`` is the chunk's row count, ``vocab_start`` its first label.
    ``WITH_D_HIDDEN`` / ``WITH_D_WEIGHT`` false: that output's products are not computed."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    t_ok = offs_t < n_tokens
    v_ok = offs_v < n_vocab
    logits = _logit_tile(
        hidden_ptr, weight_ptr, offs_t, offs_v, n_tokens, n_vocab, width, stride_h, stride_w,
        BLOCK_T, BLOCK_V, BLOCK_K, KIND, NATIVE,
    )  # fmt: skip
    logits = logits / temperature
    lse = tl.load(lse_ptr + offs_t, mask=t_ok, other=0.0)
    grad = tl.load(grad_ptr + offs_t, mask=t_ok, other=0.0) / temperature
    labels = tl.load(labels_ptr + offs_t, mask=t_ok, other=-1) - vocab_start
    probs = tl.exp(logits - lse[:, None])
    probs = tl.where(offs_v[None, :] == labels[:, None], probs - 1.0, probs)
    probs = tl.where(t_ok[:, None] & v_ok[None, :], probs * grad[:, None], 0.0)
    probs_op = probs.to(weight_ptr.dtype.element_ty) if NATIVE else probs
    for k0 in range(0, width, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < width
        if WITH_D_HIDDEN:
            w = tl.load(
                weight_ptr + offs_v[:, None] * stride_w + offs_k[None, :],
                mask=v_ok[:, None] & k_ok[None, :],
                other=0,
            )
            d_h = _dot(probs_op, _operand(w, KIND, NATIVE), KIND, NATIVE)
            tl.atomic_add(
                d_hidden_ptr + offs_t[:, None] * width + offs_k[None, :],
                d_h,
                mask=t_ok[:, None] & k_ok[None, :],
            )
        if WITH_D_WEIGHT:
            h = tl.load(
                hidden_ptr + offs_t[:, None] * stride_h + offs_k[None, :],
                mask=t_ok[:, None] & k_ok[None, :],
                other=0,
            )
            d_w = _dot(tl.trans(probs_op), _operand(h, KIND, NATIVE), KIND, NATIVE)
            tl.atomic_add(
                d_weight_ptr + offs_v[:, None] * width + offs_k[None, :],
                d_w,
                mask=v_ok[:, None] & k_ok[None, :],
            )
