"""lomo_kernels: fused, sync-free LOMO and AdaLomo for full-parameter fine-tuning.

from lomo_kernels import Lomo, AdaLomo      # drop-in for lomo_optim
from lomo_kernels import ops                 # the fused per-parameter kernels
"""

from . import ops
from .optim import AdaLomo, DynamicLossScaler, Lomo


def enable_transformers() -> None:
    """Makes transformers' ``optim="lomo"/"adalomo"`` and accelerate's LOMO path use this
    package (see lomo_kernels.integrations.huggingface); needs transformers and accelerate."""
    from .integrations.huggingface import enable_transformers as enable

    enable()


def disable_transformers() -> None:
    """Undoes `enable_transformers()`."""
    from .integrations.huggingface import disable_transformers as disable

    disable()


__all__ = [
    "AdaLomo",
    "Lomo",
    "DynamicLossScaler",
    "disable_transformers",
    "enable_transformers",
    "ops",
]
__version__ = "0.1.0"
