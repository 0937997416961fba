"""The executable specification of the fused linear + cross-entropy ops, in float64.

``loss[t] = logsumexp(z[t]) - z[t, labels[t]]`` with ``z = (hidden @ weight.T) / temperature``
for every token whose label is not ``ignore_index`` (0 for the others); the backward of
``sum(grad_loss * loss)``. Everything is computed from the float64 values of the inputs with
the whole ``tokens x vocab`` logits materialised: slow and memory-hungry on purpose, the
yardstick for the blocked kernels.
"""

from __future__ import annotations

import torch


def logits64(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return (hidden.double() @ weight.double().T) / temperature


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and log-sum-exp (of the logits over `temperature`), float64."""
    logits = logits64(hidden, weight, temperature)
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
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(grad_loss * loss)`` with respect to hidden and weight, float64."""
    logits = logits64(hidden, weight, temperature)
    counted = labels != ignore_index
    probs = torch.softmax(logits, dim=1)
    rows = torch.nonzero(counted).squeeze(1)
    probs[rows, labels[rows]] -= 1.0
    # d z / d (hidden @ weight.T) = 1 / temperature
    dlogits = probs * (torch.where(counted, grad_loss.double(), 0.0) / temperature)[:, None]
    return dlogits @ weight.double(), dlogits.T @ hidden.double()
