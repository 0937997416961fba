"""The torch versions on which compiled autograd is tested, and the refusal elsewhere."""

from __future__ import annotations

import re

import torch

from ..core import torch_internals
from . import scope

# Versions on which compiled autograd with these patches is tested (`make
# test-compile-versions`). Matched by major.minor: the private capture and Inductor APIs
# patched here change between minor releases, while patch releases carry targeted fixes
# only; local suffixes (+cpu, +cu128) are builds of the same code.
TESTED_TORCH_VERSIONS = ("2.11.0", "2.13.0", "2.15.0")
TORCH_VERSION = str(torch.__version__)  # the version `check_supported` judges

UNTESTED_MESSAGE = (
    "lomo_kernels: compiled autograd is enabled, but torch {version} is not a version on "
    "which lomo_kernels tests its in-backward updates under compiled autograd (tested: "
    "{tested}, and their patch releases); they could be silently wrong, so nothing was "
    "updated. Eager backward and torch.compile of the forward alone keep working on any "
    "version: run the backward without compiled autograd."
)

UNSUPPORTED_MESSAGE = (
    "lomo_kernels: compiled autograd is enabled, but this torch ({version}) lacks {missing}, "
    "which lomo_kernels adjusts to keep in-backward updates after every read of the "
    "parameter; such updates would be silently wrong, so nothing was updated. Run the "
    "backward without compiled autograd (torch.compile of the forward alone is supported)."
)


def _series(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as 2.13.0+cpu; None if it has none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def torch_version_tested(version: str) -> bool:
    """Whether `version` is a patch release of one of TESTED_TORCH_VERSIONS."""
    series = _series(version)
    return series is not None and series in {_series(v) for v in TESTED_TORCH_VERSIONS}


def compiled_autograd_active() -> bool:
    """Whether a backward started now would be traced by compiled autograd."""
    return torch_internals.compiled_autograd_enabled()


def check_supported() -> None:
    """Before a backward of ours: when compiled autograd is on, adjusts its capture for our
    hooks (`scope.install`, the first time), or raises before any update where this torch
    is untested or lacks what the adjustment needs.

    Called eagerly (outside any traced code): the first call patches torch's classes.
    """
    if not compiled_autograd_active():
        if not torch_internals.compiled_autograd_state_readable():
            # Whether compiled autograd runs the coming backward cannot be told: adjust its
            # capture now (the adjustment leaves every other capture as torch makes it).
            scope.install()
        return
    if not torch_version_tested(TORCH_VERSION):
        tested = ", ".join(TESTED_TORCH_VERSIONS)
        raise RuntimeError(UNTESTED_MESSAGE.format(version=TORCH_VERSION, tested=tested))
    if not scope.install():
        raise RuntimeError(
            UNSUPPORTED_MESSAGE.format(version=TORCH_VERSION, missing=scope.missing())
        )
