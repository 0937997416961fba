"""`python -m bench.memory` over several batch shapes: one process per configuration and
shape (`forward_graph`, the activations, added once per shape), each peak split into its
parts, the shapes table with the LOMO target, and a failed process reported rather than
fatal. The processes are replaced by given figures here; what a process measures is
tests/benchmarks/test_memory.py's."""

from __future__ import annotations

import json

import pytest
from support.bench_cli import build_parser, main

from bench import memory
from bench.common.process import ProcessFailed

MODEL_MIB = 100.0
LARGEST = 2**20  # elements of the largest parameter: 4 MiB as an fp32 gradient
# Peak above the model per sequence, and optimizer state (MiB).
PEAK = {"forward_graph": 10.0, "lomo": 13.0, "adamw": 60.0}
STATE = {"forward_graph": 0.0, "lomo": 0.0, "adamw": 40.0}


@pytest.fixture
def processes(monkeypatch) -> list[tuple]:
    """Every process started: (config, batch, seq, settings); AdamW at batch 2 fails."""
    started = []

    def measured(config: str, batch: int, seq: int, **settings):
        started.append((config, batch, seq, settings))
        if (config, batch) == ("adamw", 2):
            raise ProcessFailed(f"{config} {batch}x{seq}", 1, "out of luck")
        return {
            "config": config,
            "batch": batch,
            "seq": seq,
            "model": "tiny",
            "num_parameters": 8,
            "model_mb": MODEL_MIB,
            "largest_param_numel": LARGEST,
            "dtype": "fp32",
            "attn_implementation": "sdpa",
            "fused_head": False,
            "threads": 2,
            "peak_above_model_mb": PEAK[config] * batch,
            "state_mb": STATE[config],
        }

    monkeypatch.setattr(memory, "measure_isolated", measured)
    return started


def test_every_configuration_at_every_shape(processes, tmp_path, capsys):
    out = tmp_path / "memory.json"
    argv = ["memory", "--model", "tiny", "--dtype", "fp32", "--shapes", "1x16,2x16"]
    argv += ["--optimizers", "lomo,adamw", "--no-progress", "--json", str(out)]
    assert main(argv) == 1  # a process failed
    settings = {"steps": 3, "model": "tiny", "dtype": "fp32", "device": "cpu"}
    settings["fused_head"] = False
    assert processes == [
        (config, batch, 16, settings)
        for batch in (1, 2)
        for config in ("forward_graph", "lomo", "adamw")
    ]
    result = json.loads(out.read_text())
    assert [(r["config"], r["batch"]) for r in result["split"]] == [
        ("lomo", 1),
        ("adamw", 1),
        ("lomo", 2),
    ]
    for row in result["split"]:
        activations = PEAK["forward_graph"] * row["batch"]
        above = PEAK[row["config"]] * row["batch"]
        state = STATE[row["config"]]
        assert row["parts_mib"] == {
            "parameters": MODEL_MIB,
            "gradients": above - state - activations,
            "optimizer_states": state,
            "activations": activations,
        }
        assert sum(row["parts_mib"].values()) == row["peak_mib"] == MODEL_MIB + above
    assert "out of luck" in result["raw"][-1]["error"]
    printed = capsys.readouterr()
    assert "out of luck" in printed.err
    lines = printed.out.splitlines()
    assert "| torch.optim.AdamW | 60 | error |" in lines
    assert "| lomo_kernels.Lomo (fused_backward) | 13 | 26 |" in lines
    gradient = LARGEST * 4 / 2**20
    targets = [(PEAK["forward_graph"] * b + gradient) * 1.05 for b in (1, 2)]
    target_line = next(line for line in lines if line.startswith("LOMO target"))
    assert target_line == (
        f"LOMO target (activations + largest fp32 gradient, +5%): 1 x 16: {targets[0]:.0f} "
        f"MiB, 2 x 16: {targets[1]:.0f} MiB."
    )
    assert lines[-1] == "failed (error on stderr and in the JSON): adamw 2x16"


def test_one_shape_prints_its_split_alone(processes, capsys):
    argv = ["memory", "--model", "tiny", "--batch", "1", "--seq", "8"]
    assert main([*argv, "--optimizers", "lomo", "--no-progress"]) == 0
    assert [p[:3] for p in processes] == [("forward_graph", 1, 8), ("lomo", 1, 8)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("tiny: 0M parameters, fp32, batch 1 x 8, attention sdpa;")
    assert lines[-1] == "| Lomo (ours) | 113 | 13 | 100 | 3 | 0 | 10 |"


def test_all_configurations_and_shapes_are_parsed(capsys):
    args = build_parser("memory").parse_args(["--optimizers", "all"])
    assert args.configs == list(memory.CONFIGS) and args.shapes is None
    args = build_parser("memory").parse_args(["--shapes", "1x64, 2X256"])
    assert args.shapes == [(1, 64), (2, 256)]
    args = build_parser("memory").parse_args(["--optimizers", "lomo-optim,lomo"])
    assert args.configs == ["official_lomo", "lomo"]
    for bad in ("1x", "0x64", "x", ","):
        with pytest.raises(SystemExit) as exc:
            build_parser("memory").parse_args(["--shapes", bad])
        assert exc.value.code == 2
        assert "--shapes:" in capsys.readouterr().err
