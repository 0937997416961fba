"""A refused command line: one stderr line, exit status 2, no traceback, nothing on stdout."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest


def refusal(
    capsys, argv: Sequence[str], entry: Callable[[Sequence[str]], int] | None = None
) -> str:
    """The one stderr line of `entry(argv)` refused (the studies' `main` when None)."""
    if entry is None:
        from .bench_cli import main as entry
    with pytest.raises(SystemExit) as exc:
        entry(list(argv))
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert "Traceback" not in err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]
