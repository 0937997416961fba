"""`python -m bench.single_backward`, `bench.compile` and `bench.head_sweeps` on tiny models,
through the command line: one row per configuration asked for, positive times, and ratios
that are those of the times they come from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.bench_cli import main
from support.dependencies import require

from lomo_kernels.ops import cross_entropy as lce


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_cli(argv: list[str], tmp_path: Path, capsys) -> tuple[str, dict[str, Any]]:
    """The printed output and the JSON of one benchmark run."""
    out = tmp_path / "result.json"
    assert main([*argv, "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_single_backward_times_both_modes_of_each_configuration(tmp_path, capsys, restore_threads):
    require("transformers")
    argv = ["single_backward", "--steps", "2", "--batch", "1", "--seq", "8"]
    printed, result = run_cli([*argv, "--configs", "lomo-fp32,adalomo-bf16"], tmp_path, capsys)
    rows = result["results"]
    assert [r["config"] for r in rows] == [
        "Lomo clip_grad_norm=1, fp32",
        "AdaLomo clip_grad_norm=1, bf16",
    ]
    for r in rows:
        assert r["exact_ms"] > 0 and r["single_ms"] > 0
        assert r["ratio"] == pytest.approx(r["single_ms"] / r["exact_ms"])
        assert f"{r['config']:34} {r['exact_ms']:11.1f}" in printed
    assert result["machine"]["batch"] == 1 and result["machine"]["steps"] == 2


def test_compile_times_each_loop_asked_for(tmp_path, capsys, restore_threads):
    require("transformers")
    argv = ["compile", "--ways", "eager", "--hidden", "64", "--layers", "1"]
    argv += ["--batch", "1", "--seq", "8", "--repeats", "2", "--warmup", "1"]
    printed, result = run_cli(argv, tmp_path, capsys)
    assert list(result["median_step_s"]) == ["eager"]
    assert result["median_step_s"]["eager"] > 0
    assert "warm-up eager:" in printed
    assert f"| eager | {result['median_step_s']['eager'] * 1e3:.1f} | 1.00x |" in printed
    # vocab x hidden twice (embedding and head) and one layer of hidden 64.
    assert result["machine"]["parameters"] > 2 * 8000 * 64


def test_head_sweeps_ratios_and_buffer_sizes(tmp_path, capsys):
    vocab, hidden, tokens = 512, 32, 64
    argv = ["head_sweeps", "--tokens", str(tokens), "--vocab", str(vocab)]
    printed, result = run_cli([*argv, "--hidden", str(hidden), "--repeats", "2"], tmp_path, capsys)
    medians = result["median_s"]
    assert list(medians) == ["full", "measure", "hidden"]
    assert all(seconds > 0 for seconds in medians.values())
    for name, seconds in medians.items():
        assert result["ratio_to_full"][name] == pytest.approx(seconds / medians["full"])
        assert f"| {name} | {seconds * 1e3:.2f} |" in printed
    # The materialised gradient: vocab x hidden fp32 elements; a chunk is at most that.
    assert result["materialised_gradient_mib"] == vocab * hidden * 4 / 2**20
    chunk = lce.chunk_rows(vocab, hidden)
    assert 0 < chunk <= vocab
    assert result["chunk_mib"] == chunk * hidden * 4 / 2**20
