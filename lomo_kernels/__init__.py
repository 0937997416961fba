"""lomo_kernels: fused, sync-free LOMO and AdaLomo for full-parameter fine-tuning.

from lomo_kernels import Lomo, AdaLomo      # drop-in for lomo_optim
from lomo_kernels import ops                 # the fused per-parameter kernels
"""

import torch

from . import ops
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .optim import AdaLomo, DynamicLossScaler, Lomo


def enable_transformers() -> None:
    """Makes transformers' ``optim="lomo"/"adalomo"`` and accelerate's LOMO path use this
    package (see lomo_kernels.integrations.huggingface); needs transformers and accelerate,
    not lomo-optim."""
    from .integrations.huggingface import enable_transformers as enable

    enable()


def enable_trl() -> None:
    """`enable_transformers()`, and TRL's SFTTrainer keeps the logits-free head of a model
    patched by `patch_causal_lm` (see lomo_kernels.integrations.trl_sft); needs trl."""
    from .integrations.trl_sft import enable_trl as enable

    enable()


def disable_trl() -> None:
    """Undoes `enable_trl()` (and `enable_transformers()`)."""
    from .integrations.trl_sft import disable_trl as disable

    disable()


def patch_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """Makes a transformers causal LM's loss logits-free (fused linear + cross-entropy); see
    lomo_kernels.integrations.causal_lm."""
    from .integrations.causal_lm import patch_causal_lm as patch

    return patch(model)


def unpatch_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """Undoes `patch_causal_lm`: the model computes its logits and transformers' loss again."""
    from .integrations.causal_lm import unpatch_causal_lm as unpatch

    return unpatch(model)


def disable_transformers() -> None:
    """Undoes `enable_transformers()`."""
    from .integrations.huggingface import disable_transformers as disable

    disable()


__all__ = [
    "AdaLomo",
    "CheckpointError",
    "Lomo",
    "DynamicLossScaler",
    "disable_transformers",
    "disable_trl",
    "enable_transformers",
    "enable_trl",
    "load_checkpoint",
    "patch_causal_lm",
    "save_checkpoint",
    "unpatch_causal_lm",
    "ops",
]
__version__ = "0.1.0"
