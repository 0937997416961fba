"""Launchers of the fused linear + cross-entropy Triton kernels (device code:
`linear_cross_entropy_kernels.py`); the same functions as `blocked_backend.py`."""

from __future__ import annotations

import torch

from ...kernels.triton.runtime import (
    KIND,
    cdiv,
    interpret_mode,
    kernels,
    on_first_argument_device,
    storage,
)

# Tile shapes (compile-time: they size the programs' registers). The interpreter runs the
# smallest tiles tl.dot accepts, so tests stay fast on awkward sizes.
GPU_TILES = {"BLOCK_T": 64, "BLOCK_V": 128, "BLOCK_K": 64}
INTERPRETER_TILES = {"BLOCK_T": 16, "BLOCK_V": 16, "BLOCK_K": 16}


def _launch_args(t: torch.Tensor) -> tuple[torch.Tensor, dict[str, int | bool]]:
    native = not interpret_mode()
    tiles = INTERPRETER_TILES if not native else GPU_TILES
    return (t if native else storage(t)), {**tiles, "KIND": KIND[t.dtype], "NATIVE": native}


@on_first_argument_device
def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, weight = hidden.contiguous(), weight.contiguous()
    tokens, width = hidden.shape
    loss = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(loss)
    h, meta = _launch_args(hidden)
    w, _ = _launch_args(weight)
    grid = (cdiv(tokens, meta["BLOCK_T"]),)
    kernels("linear_cross_entropy_kernels").forward_kernel[grid](
        h, w, labels.contiguous(), loss, lse,
        tokens, weight.shape[0], width, h.stride(0), w.stride(0), ignore_index,
        float(temperature), **meta,
    )  # fmt: skip
    return loss, lse


@on_first_argument_device
def backward_chunk(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight_chunk: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    vocab_start: int,
    d_hidden: torch.Tensor | None,
    d_weight_chunk: torch.Tensor | None,
    temperature: float = 1.0,
) -> None:
    hidden, weight_chunk = hidden.contiguous(), weight_chunk.contiguous()
    tokens, width = hidden.shape
    if d_weight_chunk is not None:
        d_weight_chunk.zero_()
    h, meta = _launch_args(hidden)
    w, _ = _launch_args(weight_chunk)
    grid = (cdiv(tokens, meta["BLOCK_T"]), cdiv(weight_chunk.shape[0], meta["BLOCK_V"]))
    # A skipped output's pointer is never dereferenced (its products are compiled out).
    kernels("linear_cross_entropy_kernels").backward_kernel[grid](
        grad_loss.contiguous(), h, w, labels.contiguous(), lse.contiguous(),
        lse if d_hidden is None else d_hidden,
        lse if d_weight_chunk is None else d_weight_chunk,
        tokens, weight_chunk.shape[0], width, vocab_start, h.stride(0), w.stride(0),
        float(temperature),
        WITH_D_HIDDEN=d_hidden is not None, WITH_D_WEIGHT=d_weight_chunk is not None, **meta,
    )  # fmt: skip
