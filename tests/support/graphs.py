"""Autograd graphs built by hand for the graph walks' tests, their shape known by
construction."""

from __future__ import annotations

import torch


def diamonds(weight: torch.Tensor, levels: int) -> torch.Tensor:
    """A loss whose every level reaches the one below it twice: 2^levels paths over 3 nodes
    a level (two products and their sum), the sum's node on top and `weight`'s leaf below."""
    x = weight
    for _ in range(levels):
        x = x * 2 + x * 3
    return x.sum()
