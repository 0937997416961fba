"""The executable specification of the fused linear + cross-entropy ops, in float64.

``loss[t] = logsumexp(hidden[t] @ weight.T) - (hidden[t] @ weight.T)[labels[t]]`` for every
token whose label is not ``ignore_index`` (0 for the others); the backward of
``sum(grad_loss * loss)``. Everything is computed from the float64 values of the inputs with
the whole ``tokens x vocab`` logits materialised: slow and memory-hungry on purpose, the
yardstick for the blocked kernels.
"""

from __future__ import annotations

import torch


def logits64(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden.double() @ weight.double().T


def forward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and log-sum-exp, float64."""
    logits = logits64(hidden, weight)
    lse = torch.logsumexp(logits, dim=1)
    counted = labels != ignore_index
    safe = torch.where(counted, labels, 0)
    target = logits.gather(1, safe[:, None]).squeeze(1)
    return torch.where(counted, lse - target, 0.0), lse


def backward(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(grad_loss * loss)`` with respect to hidden and weight, float64."""
    logits = logits64(hidden, weight)
    counted = labels != ignore_index
    probs = torch.softmax(logits, dim=1)
    rows = torch.nonzero(counted).squeeze(1)
    probs[rows, labels[rows]] -= 1.0
    dlogits = probs * torch.where(counted, grad_loss.double(), 0.0)[:, None]
    return dlogits @ weight.double(), dlogits.T @ hidden.double()
