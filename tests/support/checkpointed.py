"""What the one-process checkpoint tests save and load."""

from __future__ import annotations

from lomo_kernels import AdaLomo
from support.models import batch, tiny_llama


def trained_with_moments(seed: int = 0, steps: int = 1):
    """A tiny LLaMA and an AdaLomo with moments (so an unchanged state means something)."""
    model = tiny_llama(seed=seed)
    opt = AdaLomo(model, lr=0.01, clip_grad_norm=1.0, single_backward=True)
    for index in range(steps):
        opt.fused_backward(model(**batch(index)).loss)
    return model, opt
