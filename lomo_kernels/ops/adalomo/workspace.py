"""The fp32 workspace one AdaLomo step of one parameter uses, shared by every backend.

One tensor per parameter per step, zeroed by its single allocation:
``[row sums (rows) | column sums (cols) | P_SUMSQ, U_SUMSQ, G_SUMSQ, SKIP, R_SUM]`` for
tensors with >= 2 dims (viewed as [rows, cols], cols = shape[-1]), only the slots for 1-D
tensors. The C++/CUDA sources (csrc/adalomo_math.h) and the Triton kernels repeat the slot
numbers.
"""

from __future__ import annotations

import torch

P_SUMSQ = 0  # sum of param^2 (fp32 of the stored values)
U_SUMSQ = 1  # sum of update^2 before the rms clip
G_SUMSQ = 2  # sum of (grad * inv_scale)^2 before clamping (factored tensors, pass A)
SKIP = 3  # non-zero: this parameter is not updated (skip_if set, or a non-finite gradient)
R_SUM = 4  # sum of the updated row moments (factored tensors)
NUM_SLOTS = 5


def workspace_numel(shape: torch.Size) -> int:
    """Length of the fp32 workspace of a parameter of `shape`."""
    if len(shape) >= 2:
        cols = shape[-1]
        rows = shape.numel() // cols if cols else 0
        return rows + cols + NUM_SLOTS
    return NUM_SLOTS


def stats_slots(workspace: torch.Tensor) -> torch.Tensor:
    """The NUM_SLOTS slots after a workspace's row and column sums (a view)."""
    return workspace[workspace.numel() - NUM_SLOTS :]


def measured_view(workspace: torch.Tensor) -> torch.Tensor:
    """The 2-element view [G_SUMSQ, SKIP] of a workspace after pass A (run without skip_if):
    the gradient's sum of squares and its non-finite flag, adjacent so that one add
    accumulates both."""
    start = workspace.numel() - NUM_SLOTS + G_SUMSQ
    return workspace[start : start + 2]
