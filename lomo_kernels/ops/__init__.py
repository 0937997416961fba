"""The fused ops of LOMO and AdaLomo: one `torch.library` op per fused pass.

    spec.py                each op described once (arguments, kinds, mutability): schema,
                           fake, public checks and backend argument lists derive from it
    lomo.py                LOMO: specs and public functions (fused_lomo_update_, grad_sumsq_)
    lomo_reference.py      their executable specification in PyTorch
    adalomo.py             AdaLomo: the six passes' specs, public functions, adalomo_update_
    adalomo_reference.py   their executable specification
    adalomo_workspace.py   the per-step fp32 workspace every AdaLomo backend shares
    backends.py            the ops' definition and per-device kernels
    eager.py               eager calls straight to the kernel (no dispatcher layers to pay)
    selection.py           backend choice (argument, $LOMO_KERNELS_BACKEND, availability)
    scalars.py             runtime scalars: 1-element fp32 device tensors, converted once
    checks.py              argument validation, before anything is written
    cross_entropy.py       fused linear + cross-entropy (linear_cross_entropy, causal_lm_loss)
    cross_entropy_reference.py   its float64 specification
    head_gradient.py       where the head's weight gradient goes in that loss's backward
    embedding_backward.py  ATen's embedding backward as an op Inductor keeps (compiled autograd)

The kernels themselves live in `lomo_kernels.kernels` (cpp/, triton/) and `csrc/`.
"""

from . import embedding_backward  # noqa: F401  (registers its op)
from .adalomo import (
    adalomo_factored_apply_,
    adalomo_factored_moments_,
    adalomo_factored_norm_,
    adalomo_factored_stats_,
    adalomo_update_,
    adalomo_vector_apply_,
    adalomo_vector_stats_,
    adalomo_workspace,
    init_adalomo_state,
)
from .cross_entropy import causal_lm_loss, linear_cross_entropy
from .lomo import clip_coef_from_sumsq, fused_lomo_update_, fused_sgd_update_, grad_sumsq_

__all__ = [
    "adalomo_factored_apply_",
    "adalomo_factored_moments_",
    "adalomo_factored_norm_",
    "adalomo_factored_stats_",
    "adalomo_update_",
    "adalomo_vector_apply_",
    "adalomo_vector_stats_",
    "adalomo_workspace",
    "causal_lm_loss",
    "clip_coef_from_sumsq",
    "fused_lomo_update_",
    "fused_sgd_update_",
    "grad_sumsq_",
    "init_adalomo_state",
    "linear_cross_entropy",
]
