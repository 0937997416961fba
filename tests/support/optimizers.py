"""The in-backward optimizers by the names tests give them."""

from __future__ import annotations

from lomo_kernels import AdaLomo, Lomo

OPTIMIZERS = {"lomo": Lomo, "adalomo": AdaLomo}
