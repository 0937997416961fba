"""The input embedding's weight gradient.

- ``lomo_kernels::embedding_dense_backward_eager``: ATen's embedding backward, opaque to
  Inductor (used by `lomo_kernels.compile.embedding_backward` in compiled-autograd graphs).
- `embedding_rows`: the embedding lookup whose backward, where a Lomo steps the weight in
  backward, hands the owner only the rows the batch used (their summed gradients, at most
  tokens x hidden fp32) instead of the dense ``vocab x hidden`` gradient
  (`patch_causal_lm` routes the input embedding through it).
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.gradient_sink import GradientSink, gradient_sink_for
from ...core.spec import Arg, OpSpec
from ..definition import define_returning


def embedding_dense_backward(
    grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int
) -> torch.Tensor:
    """ATen's own embedding backward, opaque to Inductor (which would decompose it)."""
    return torch.ops.aten.embedding_dense_backward.default(
        grad, indices, num_weights, padding_idx, False
    )


def _fake(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int) -> Any:
    return grad.new_empty((num_weights, *grad.shape[indices.dim() :]))


DENSE_BACKWARD = OpSpec(
    "embedding_dense_backward_eager",
    "embedding_dense_backward",
    (
        Arg("grad", "tensor"),
        Arg("indices", "tensor"),
        Arg("num_weights", "const"),
        Arg("padding_idx", "const"),
    ),
    returns=("grad_weight",),
)
_embedding_dense_backward_eager = define_returning(DENSE_BACKWARD, embedding_dense_backward, _fake)


# -- the used-rows backward of an embedding a Lomo steps in backward ----------------------


def used_rows(
    grad: torch.Tensor, ids: torch.Tensor, padding_idx: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted distinct ids the batch used, padding_idx left out; their summed gradients in
    fp32, one row each): the dense embedding gradient's non-zero rows, at most tokens x
    hidden."""
    flat_ids = ids.reshape(-1)
    flat_grad = grad.reshape(-1, grad.shape[-1])
    if padding_idx is not None:
        counted = flat_ids != padding_idx
        flat_ids, flat_grad = flat_ids[counted], flat_grad[counted]
    unique, inverse = torch.unique(flat_ids, sorted=True, return_inverse=True)
    sums = torch.zeros((unique.numel(), grad.shape[-1]), dtype=torch.float32, device=grad.device)
    return unique, sums.index_add_(0, inverse, flat_grad.float())


def step_used_rows(
    step: GradientSink,
    grad: torch.Tensor,
    ids: torch.Tensor,
    num_weights: int,
    padding_idx: int | None,
) -> None:
    """Feeds the weight's `GradientSink` (an owning optimizer's row-block step) the embedding's
    gradient without its dense ``num_weights x hidden`` form: measured from the used rows'
    sums; applied in chunks of rows (the used rows scattered into a zeroed chunk buffer;
    chunks no id falls in are skipped unless weight decay changes every row)."""
    from ..cross_entropy import chunk_rows

    unique, sums = used_rows(grad, ids, padding_idx)
    if step.measuring or step.measure_first:
        (step.apply if step.measuring else step.measure)(0, num_weights, sums)
        if step.measuring:
            step.finish()
            return
        step.measured()
    width = grad.shape[-1]
    rows = chunk_rows(num_weights, width)
    buffer = torch.empty((rows, width), dtype=torch.float32, device=grad.device)
    starts = range(0, num_weights, rows)
    bounds = torch.searchsorted(unique, torch.tensor([*starts, num_weights], device=unique.device))
    bounds = bounds.tolist()  # one host read per step, to slice by chunk
    for i, start in enumerate(starts):
        stop = min(start + rows, num_weights)
        first, last = bounds[i], bounds[i + 1]
        if first == last and not step.changes_zero_rows:
            continue
        chunk = buffer[: stop - start].zero_()
        chunk[unique[first:last] - start] = sums[first:last]
        step.apply(start, stop, chunk)
    step.finish()


class _EmbeddingRows(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient goes to the owning
    optimizer's row-block step when it takes one, else ATen's dense gradient."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int | None):
        ctx.save_for_backward(ids)
        # As torch's own embedding backward: the row count, not the weight's values (a
        # sharding engine may have released them by then); the parameter itself only to
        # find its owner.
        ctx.weight, ctx.num_weights, ctx.padding_idx = weight, weight.shape[0], padding_idx
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        step = gradient_sink_for(ctx.weight)
        if step is None:
            padding = -1 if ctx.padding_idx is None else ctx.padding_idx
            dense = torch.ops.aten.embedding_dense_backward.default(
                grad, ids, ctx.num_weights, padding, False
            )
            return dense, None, None
        step_used_rows(step, grad, ids, ctx.num_weights, ctx.padding_idx)
        return None, None, None


def embedding_rows(
    ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None
) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)``; in a backward where a Lomo steps `weight`
    (untied, unsharded, eager), only the rows the batch used get a gradient, straight into
    its update, and the dense ``vocab x hidden`` gradient never exists."""
    return _EmbeddingRows.apply(weight, ids, padding_idx)
