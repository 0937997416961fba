"""Drop-in LOMO optimizers built on the fused ops."""

from .adalomo import AdaLomo
from .lomo import Lomo
from .loss_scaler import DynamicLossScaler

__all__ = ["AdaLomo", "Lomo", "DynamicLossScaler"]
