"""The checkpoint the one-process checkpoint tests craft and load."""

from __future__ import annotations

import pytest
from support.checkpointed import trained_with_moments

from lomo_kernels import save_checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint of `trained_with_moments()` with client_state {"step": 1}."""
    return save_checkpoint(tmp_path / "ckpt", *trained_with_moments(), client_state={"step": 1})
