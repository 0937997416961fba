"""`python -m bench.adalomo_slices` at a tiny size, through the command line: a row per
backend's sliced step and the whole matrix's, each a positive time, the printed table the
JSON's figures, and the fused passes one op each whatever the backend runs inside them."""

from __future__ import annotations

import json

import pytest
from support.bench_cli import main


def test_rows_figures_and_ops(tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = ["adalomo_slices", "--size", "96", "--ranks", "4", "--reps", "2", "--json", str(out)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(out.read_text())["results"]
    seconds, ops = result["seconds"], result["torch_ops"]
    assert list(seconds) == ["slice[cpp]", "slice[torch]", "whole"]
    assert all(value > 0 for value in seconds.values())
    # The same fused passes on either backend: the torch backend's tiles run inside them.
    assert ops["slice[cpp]"] == ops["slice[torch]"] > 0
    assert result["slice_numel"] == 96 * 96 // 4
    for name, value in seconds.items():
        row = next(line for line in lines if line.split()[:1] == [name])
        assert f"{value * 1e3:.2f} ms" in row and row.endswith(f"{ops[name]} torch ops")


def test_a_slice_too_small_is_refused():
    with pytest.raises(SystemExit, match="at least 2 ranks"):
        main(["adalomo_slices", "--size", "8", "--ranks", "1"])
