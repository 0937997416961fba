"""Test dependencies that `make setup` installs (the `test` extra, DeepSpeed, Triton).

A test that compares against one of them (lomo_optim, transformers, DeepSpeed) or checks it
must fail when it is missing, not skip: a broken install would otherwise pass the suite with
those checks silently left out.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def require(module: str) -> ModuleType:
    """`module` imported, or the calling test (or module, at collection) fails saying why."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(
            f"{module} is a test dependency (`make setup` installs it) but does not import: {exc}",
            pytrace=False,
        )
