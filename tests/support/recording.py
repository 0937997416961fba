"""A resolved LOMO backend that notes each dense update and accumulation call's arguments by
the op spec's names (the optimizers pass them by position, in the spec's order), then runs
the call: what a test reads to see how many calls a step made and with what."""

from __future__ import annotations

from typing import Any

import pytest

from lomo_kernels.ops.backends import LOMO
from lomo_kernels.ops.lomo import GRAD_ACCUMULATE, LOMO_UPDATE


class RecordingBackend:
    """`backend` (a resolved module) with `lomo_update_` and `grad_accumulate_` calls noted
    in `calls` as (op name, arguments by name)."""

    def __init__(self, backend: Any, calls: list[tuple[str, dict]]) -> None:
        self._backend = backend
        self.calls = calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def lomo_update_(self, *args: Any, **kwargs: Any) -> None:
        self._note("lomo_update_", LOMO_UPDATE.names, args, kwargs)
        self._backend.lomo_update_(*args, **kwargs)

    def grad_accumulate_(self, *args: Any, **kwargs: Any) -> None:
        self._note("grad_accumulate_", GRAD_ACCUMULATE.names, args, kwargs)
        self._backend.grad_accumulate_(*args, **kwargs)

    def _note(self, op: str, names: tuple[str, ...], args: tuple, kwargs: dict) -> None:
        self.calls.append((op, {**dict(zip(names, args, strict=False)), **kwargs}))


def record_lomo_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """Makes every LOMO backend the optimizers resolve a `RecordingBackend`; returns the
    list its calls are noted in."""
    calls: list[tuple[str, dict]] = []
    resolve = LOMO.resolve
    monkeypatch.setattr(LOMO, "resolve", lambda *a, **k: RecordingBackend(resolve(*a, **k), calls))
    return calls
