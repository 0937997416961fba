"""A pytest plugin (``pytest -p bench.gpu_check.pytest_outcomes``): every test
phase that ran a test's body or did not pass, one JSON line each in the file named by
$LOMO_GPU_CHECK_OUTCOMES, written as it ends, so that a run killed at its deadline still
tells what passed. Under pytest-xdist the controller writes them (it receives every
worker's reports); the workers write nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

OUTCOMES_ENV = "LOMO_GPU_CHECK_OUTCOMES"
MAX_MESSAGE_CHARS = 300


def message(report: Any) -> str:
    """The one line that says why a phase failed or was skipped ('' when it passed)."""
    if report.passed:
        return ""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2])[:MAX_MESSAGE_CHARS]
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    lines = text.strip().splitlines()
    return lines[0][:MAX_MESSAGE_CHARS] if lines else ""


class OutcomeWriter:
    """Appends each reported phase to `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when != "call" and report.passed:
            return  # a set-up or teardown that passed says nothing
        record = {
            "test": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "message": message(report),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_configure(config: Any) -> None:
    path = os.environ.get(OUTCOMES_ENV)
    if path and not hasattr(config, "workerinput"):  # not an xdist worker
        config.pluginmanager.register(OutcomeWriter(path), "lomo_kernels_gpu_check_outcomes")
