"""The project's own metadata: set-up (pip install, python -m build) warns about nothing."""

from __future__ import annotations

import warnings
from pathlib import Path

from support.dependencies import require

setuptools = require("setuptools")
from setuptools.config.pyprojecttoml import apply_configuration  # noqa: E402
from setuptools.dist import Distribution  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_applies_without_deprecation_warnings():
    """setuptools reads pyproject.toml as the build backend does; a deprecated field (a
    license table, a license classifier) warns here as it does in `pip install -e .`."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist = apply_configuration(Distribution(), PYPROJECT)
    assert dist.get_name() == "lomo_kernels"
    assert dist.metadata.license_expression == "Apache-2.0"
