"""The devices a test taking `device` runs on: CPU, and CUDA marked `cuda` (`make test-gpu`
selects those with ``-m cuda``), skipped with the reason where it cannot run."""

from __future__ import annotations

import os

import pytest
import torch


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device here: runs on a GPU machine with `make test-gpu`"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 would run Inductor's GPU kernels interpreted: `make test-gpu`"
    return None


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(_cuda_skip_reason() is not None, reason=str(_cuda_skip_reason())),
    ],
)
DEVICES = [pytest.param("cpu"), CUDA]
