"""The fused ops of LOMO and AdaLomo: one `torch.library` op per fused pass.

One package per op family: its specs (spec.py, for LOMO and AdaLomo) and public functions
(__init__.py), beside them its executable specification (reference.py), its backends
(triton_backend.py, cpp_backend.py; the head: triton_backend.py, blocked_backend.py) and
what else belongs to it only:
    lomo/                  LOMO: fused_lomo_update_, fused_sgd_update_, grad_sumsq_,
                           grad_accumulate_; the 8-bit buffer's grad_accumulate_int8_,
                           lomo_update_int8_, int8_dequantize_
    adalomo/               AdaLomo: the six passes, adalomo_update_; workspace.py, the
                           per-step fp32 workspace every AdaLomo backend shares
    cross_entropy/         fused linear + cross-entropy (linear_cross_entropy, causal_lm_loss);
                           head_gradient.py: where the head's weight gradient goes
    embedding/             the used-rows embedding (embedding_rows), and ATen's embedding
                           backward as an op Inductor keeps (compiled autograd)
Shared by the families:
    backends.py            which kernel runs, for every op and device, decided here
    definition.py          each op defined once with torch.library (schema, fake, kernels)
    eager.py               eager calls straight to the kernel (no dispatcher layers to pay)

The device code the backends launch lives in `lomo_kernels.kernels` and `csrc/`.
"""

from . import embedding  # noqa: F401  (registers its op)
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
from .lomo import (
    clip_coef_from_sumsq,
    fused_lomo_update_,
    fused_sgd_update_,
    grad_accumulate_,
    grad_accumulate_int8_,
    grad_sumsq_,
    int8_dequantize_,
    lomo_update_int8_,
)

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
    "grad_accumulate_",
    "grad_accumulate_int8_",
    "grad_sumsq_",
    "init_adalomo_state",
    "int8_dequantize_",
    "linear_cross_entropy",
    "lomo_update_int8_",
]
