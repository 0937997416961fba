"""`python -m bench.adalomo_slices` at a tiny size, through the command line: a row per
backend's sliced step and the whole matrix's, each a positive time, the printed table the
JSON's figures, and the fused passes one op each whatever the backend runs inside them; a
bucket of slices launches each slice's fused passes and the bucket's other ops once."""

from __future__ import annotations

import json

import pytest
from support.bench_cli import main


def _run(tmp_path, capsys, *options: str) -> tuple[dict, list[str]]:
    out = tmp_path / "result.json"
    argv = ["adalomo_slices", "--size", "96", "--ranks", "4", "--reps", "2", *options]
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())["results"], capsys.readouterr().out.splitlines()


def test_rows_figures_and_ops(tmp_path, capsys):
    result, lines = _run(tmp_path, capsys)
    seconds, ops, launching = result["seconds"], result["torch_ops"], result["launching_ops"]
    assert list(seconds) == ["slice[cpp]", "slice[torch]", "whole"]
    assert all(value > 0 for value in seconds.values())
    # The same fused passes on either backend: the torch backend's tiles run inside them.
    assert ops["slice[cpp]"] == ops["slice[torch]"] > 0
    assert result["slice_numel"] == 96 * 96 // 4
    for name, value in seconds.items():
        row = next(line for line in lines if line.split()[:1] == [name])
        assert f"{value * 1e3:.2f} ms" in row
        assert row.endswith(f"{ops[name]} torch ops, {launching[name]:>5} launching")
        assert 0 < launching[name] <= ops[name]


def test_a_bucket_launches_each_slice_s_passes_and_the_rest_once(tmp_path, capsys):
    """Three slices launch three times the fused passes (four per matrix slice) and the
    bucket's other ops once: two more slices, eight more launching ops."""
    one, _ = _run(tmp_path, capsys)
    three, lines = _run(tmp_path, capsys, "--slices", "3")
    assert three["slices"] == 3 and any("a bucket of 3 slices" in line for line in lines)
    for name in ("slice[cpp]", "slice[torch]"):
        assert three["launching_ops"][name] == one["launching_ops"][name] + 2 * 4


def test_a_slice_too_small_is_refused():
    with pytest.raises(SystemExit, match="at least 2 ranks"):
        main(["adalomo_slices", "--size", "8", "--ranks", "1"])
