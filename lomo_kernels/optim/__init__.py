"""Drop-in LOMO optimizers built on the fused ops."""

from .lomo import Lomo
from .loss_scaler import DynamicLossScaler

__all__ = ["Lomo", "DynamicLossScaler"]
