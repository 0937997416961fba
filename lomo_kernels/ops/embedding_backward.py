"""torch.library op: ATen's embedding backward, opaque to Inductor (used by
`lomo_kernels.compile.embedding_backward` in compiled-autograd graphs)."""

from __future__ import annotations

from typing import Any

import torch


@torch.library.custom_op("lomo_kernels::embedding_dense_backward_eager", mutates_args=())
def _embedding_dense_backward_eager(
    grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int
) -> torch.Tensor:
    """ATen's own embedding backward, opaque to Inductor (which would decompose it)."""
    return torch.ops.aten.embedding_dense_backward.default(
        grad, indices, num_weights, padding_idx, False
    )


@_embedding_dense_backward_eager.register_fake
def _(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int) -> Any:
    return grad.new_empty((num_weights, *grad.shape[indices.dim() :]))
