"""lomo_kernels: fused, sync-free LOMO and AdaLomo for full-parameter fine-tuning.

from lomo_kernels import Lomo, AdaLomo      # drop-in for lomo_optim
from lomo_kernels import ops                 # the fused per-parameter kernels
"""

from . import ops
from .optim import AdaLomo, DynamicLossScaler, Lomo

__all__ = ["AdaLomo", "Lomo", "DynamicLossScaler", "ops"]
__version__ = "0.1.0"
