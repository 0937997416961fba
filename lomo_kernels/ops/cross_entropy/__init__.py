"""Fused linear + cross-entropy: the loss of ``hidden @ weight.T`` against labels without the
``tokens x vocab`` logits ever existing.

    linear_cross_entropy   loss of a linear head (mean / sum / per token), differentiable
    causal_lm_loss         transformers' causal-LM loss (shift, ignore_index, num_items_in_batch)

Two ops (``lomo_kernels::linear_cross_entropy_forward`` / ``_backward``). Their logits are
``(hidden @ weight.T) / temperature`` (1 for a loss; sampling's temperature for the
log-probabilities TRL's GRPO and RLOO score completions with), divided inside each block of
the kernels, so nothing the size of the logits is ever scaled. The forward keeps
one fp32 log-sum-exp per token; the backward recomputes the logits block by block, walking
the vocabulary in chunks: each chunk's weight gradient is complete when the chunk is done,
and goes either into ``weight.grad``'s buffer or, when an in-backward optimizer owns the
weight, straight into its update (`head_gradient.py`), so the ``vocab x hidden`` gradient
never exists either. Kernels: chosen by `backends.linear_cross_entropy_kernels`; the
float64 specification is `reference.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core.checks import check_finite
from ...core.spec import Arg, OpSpec
from ..backends import linear_cross_entropy_kernels
from ..definition import define_returning
from .head_gradient import head_backward

# Rows of the vocabulary per backward chunk: the chunk's fp32 weight gradient is the largest
# buffer of the backward, about CHUNK_ELEMENTS fp32 values (64 MiB).
CHUNK_ELEMENTS = 16 * 2**20
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

ChunkSink = Callable[[int, int, torch.Tensor], None]
# The backward op's arguments: (grad_loss, hidden, weight, labels, lse, ignore_index,
# temperature).
BackwardArgs = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float
]


def chunk_rows(vocab: int, hidden: int) -> int:
    """Rows per chunk: the largest power of two of at most CHUNK_ELEMENTS elements, at most
    the vocabulary."""
    rows = max(1, CHUNK_ELEMENTS // max(hidden, 1))
    return min(vocab, 1 << (rows.bit_length() - 1))


def backward_by_chunks(
    args: BackwardArgs,
    sink: ChunkSink | None,
    kernels=None,
    *,
    with_d_hidden: bool = True,
) -> torch.Tensor | None:
    """``d_hidden`` (in hidden's dtype; None when not `with_d_hidden`); each vocabulary
    chunk's complete fp32 weight gradient is handed to ``sink(start, stop, grad)`` as soon as
    it exists, then reused. ``sink`` None: the weight gradient's products are skipped.
    `args`: the backward op's ``(grad_loss, hidden, weight, labels, lse, ignore_index,
    temperature)``."""
    grad_loss, hidden, weight, labels, lse, ignore_index, temperature = args
    kernels = kernels or linear_cross_entropy_kernels(hidden.device)
    counted_grad = torch.where(labels != ignore_index, grad_loss.float(), 0.0)
    d_hidden = None
    if with_d_hidden:
        d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    vocab, width = weight.shape
    rows = chunk_rows(vocab, width)
    buffer = None
    if sink is not None:
        buffer = torch.empty((rows, width), dtype=torch.float32, device=hidden.device)
    for start in range(0, vocab, rows):
        stop = min(start + rows, vocab)
        chunk_grad = None if buffer is None else buffer[: stop - start]
        kernels.backward_chunk(
            counted_grad,
            hidden,
            weight[start:stop],
            labels,
            lse,
            start,
            d_hidden,
            chunk_grad,
            temperature,
        )
        if sink is not None:
            sink(start, stop, chunk_grad)
    return None if d_hidden is None else d_hidden.to(hidden.dtype)


def forward_impl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward op's implementation: (per-token fp32 loss, log-sum-exp)."""
    kernels = linear_cross_entropy_kernels(hidden.device)
    return kernels.forward(hidden, weight, labels, ignore_index, temperature)


def backward_impl(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward op's implementation: (d_hidden, the head's weight gradient)."""
    d_weight = torch.empty_like(weight)

    def write(start: int, stop: int, grad: torch.Tensor) -> None:
        d_weight[start:stop].copy_(grad)

    args = (grad_loss, hidden, weight, labels, lse, ignore_index, temperature)
    d_hidden = backward_by_chunks(args, write)
    return d_hidden, d_weight


# The two ops, declared once (`spec.py`): their schemas, the bodies' and the backends'
# `forward` argument lists come from these (tests/ops/test_op_specs.py checks the backends').
FORWARD = OpSpec(
    "linear_cross_entropy_forward",
    "forward",
    (
        Arg("hidden", "tensor"),
        Arg("weight", "tensor"),
        Arg("labels", "tensor"),
        Arg("ignore_index", "const"),
        Arg("temperature", "hyper", rule="positive"),
    ),
    returns=("loss", "lse"),
)
BACKWARD = OpSpec(
    "linear_cross_entropy_backward",
    "backward",
    (Arg("grad_loss", "tensor"), *FORWARD.args[:3], Arg("lse", "tensor"), *FORWARD.args[3:]),
    returns=("d_hidden", "d_weight"),
)


def _forward_fake(hidden, weight, labels, ignore_index, temperature):
    loss = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    return loss, torch.empty_like(loss)


def _backward_fake(grad_loss, hidden, weight, labels, lse, ignore_index, temperature):
    return torch.empty_like(hidden), torch.empty_like(weight)


_forward_op = define_returning(FORWARD, forward_impl, _forward_fake)
_backward_op = define_returning(BACKWARD, backward_impl, _backward_fake)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, labels, ignore_index, temperature = inputs
    ctx.save_for_backward(hidden, weight, labels, output[1])
    ctx.ignore_index = ignore_index
    ctx.temperature = temperature


def _backward(ctx, grad_loss, _grad_lse):
    hidden, weight, labels, lse = ctx.saved_tensors
    args = (grad_loss, hidden, weight, labels, lse, ctx.ignore_index, ctx.temperature)
    d_hidden, d_weight = head_backward(
        args, ctx.needs_input_grad[1], _backward_op, backward_by_chunks
    )
    return d_hidden, d_weight, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(
            f"lomo_kernels: the head weight must be 2-D (vocab x hidden), got {tuple(weight.shape)}"
        )
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"lomo_kernels: hidden states of width {hidden.shape[-1]} do not match a head of "
            f"width {weight.shape[1]}"
        )
    if hidden.dtype not in FLOAT_DTYPES or hidden.dtype != weight.dtype:
        raise TypeError(
            "lomo_kernels: hidden states and head weight must share one of float32, bfloat16, "
            f"float16; got {hidden.dtype} and {weight.dtype}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"lomo_kernels: labels must be int64 or int32, got {labels.dtype}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"lomo_kernels: labels of shape {tuple(labels.shape)} do not match hidden states of "
            f"shape {tuple(hidden.shape)} (one label per position)"
        )
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(
            f"lomo_kernels: hidden ({hidden.device}), weight ({weight.device}) and labels "
            f"({labels.device}) must be on one device"
        )


def _check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    # One host sync per loss; skipped while tracing (a graph cannot branch on it).
    if torch.compiler.is_compiling():
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise IndexError(
            f"lomo_kernels: label {value} is outside the vocabulary [0, {vocab}) and is not "
            f"ignore_index ({ignore_index})"
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float() / temperature, labels, ...)`` without the
    logits: ``hidden`` is ``(..., width)``, ``weight`` ``(vocab, width)``, ``labels``
    ``hidden.shape[:-1]``. ``reduction``: "mean" (over counted tokens; nan when none is
    counted, as torch), "sum", or "none" (per token, fp32: the negated log-probability of
    each label). With ``num_items_in_batch`` the sum is divided by it instead (transformers'
    gradient-accumulation convention). ``temperature`` (> 0) divides the logits inside each
    block (sampling's temperature)."""
    _check(hidden, weight, labels)
    check_finite("temperature", temperature, positive=True)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f"lomo_kernels: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
        )
    flat_labels = labels.reshape(-1).to(torch.int64)
    _check_label_range(flat_labels, weight.shape[0], ignore_index)
    loss, _lse = _forward_op(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        flat_labels,
        int(ignore_index),
        float(temperature),
    )
    if reduction == "none":
        return loss.view(labels.shape)
    total = loss.sum()
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    return total / (flat_labels != ignore_index).sum()


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' causal-LM loss of a bias-free head, logits-free: position ``i`` predicts
    label ``i + 1`` (or ``shift_labels[i]`` when given), the last position and
    ``ignore_index`` labels count for nothing; mean over counted tokens, or sum over
    ``num_items_in_batch``."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("lomo_kernels: causal_lm_loss needs labels or shift_labels")
        padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    shift_labels = shift_labels.to(hidden_states.device)
    return linear_cross_entropy(
        hidden_states,
        weight,
        shift_labels,
        ignore_index=ignore_index,
        reduction="sum" if num_items_in_batch is not None else "mean",
        num_items_in_batch=num_items_in_batch,
    )
