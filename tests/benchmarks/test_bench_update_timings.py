"""`python -m bench.update`, `bench.cpu_levels`, `bench.accumulate` and `bench.host_time` on
tiny sizes, through
the command line: every row a benchmark promises is there, every figure is a positive time,
and what the tables print agrees with the JSON they write."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from support.bench_cli import main

from lomo_kernels.ops.lomo import cpp_backend as cpp


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_cli(argv: list[str], tmp_path: Path, capsys) -> tuple[list[str], dict[str, Any]]:
    """The printed lines and the JSON of one benchmark run."""
    out = tmp_path / "result.json"
    assert main([*argv, "--json", str(out)]) == 0
    return capsys.readouterr().out.splitlines(), json.loads(out.read_text())


def all_positive(seconds: dict[str, float]) -> bool:
    return all(value > 0 for value in seconds.values())


HOST_TIME_WAYS = [
    "public (name)",
    "public (module)",
    "Lomo per tensor",
    "AdaLomo per tensor",
    "kernel alone",
    "p.add_",
]


def test_host_time_gives_a_per_call_time_for_each_way(tmp_path, capsys, restore_threads):
    argv = ["host_time", "--numel", "256", "--reps", "2", "--calls", "3"]
    lines, result = run_cli(argv, tmp_path, capsys)
    per_call = result["seconds_per_call"]
    assert list(per_call) == HOST_TIME_WAYS and all_positive(per_call)
    floor = per_call["p.add_"]
    for name, line in zip(HOST_TIME_WAYS, lines[-len(HOST_TIME_WAYS) :], strict=True):
        pattern = rf"  {re.escape(name)} +([\d.]+) us +([\d.]+)x p\.add_"
        micros, ratio = re.fullmatch(pattern, line).groups()
        assert float(micros) == pytest.approx(per_call[name] * 1e6, abs=0.006)
        assert float(ratio) == pytest.approx(per_call[name] / floor, abs=0.006)


def test_cpu_levels_one_line_per_level_dtype_and_size(tmp_path, capsys, restore_threads):
    ext = cpp._loader.module("cpu")
    levels, before = ext._cpu_isas(), ext._cpu_isa()
    argv = ["cpu_levels", "--sizes", "4K,8K", "--dtype", "bf16,fp32", "--reps", "2"]
    lines, result = run_cli(argv, tmp_path, capsys)
    assert ext._cpu_isa() == before  # the level in use is given back
    runs = [(r["dtype"], r["numel"]) for r in result["results"]]
    assert runs == [("bf16", 4096), ("bf16", 8192), ("fp32", 4096), ("fp32", 8192)]
    for r in result["results"]:
        update = [f"ours[{level}]" for level in levels]
        if r["dtype"] == "bf16":  # stochastic rounding applies to 16-bit parameters
            update += [f"sr[{level}]" for level in levels]
        assert sorted(r["update_s"]) == sorted([*update, "torch._fused_sgd_", "axpy"])
        assert list(r["sumsq_s"]) == [*(f"sumsq[{level}]" for level in levels), "vector_norm"]
        # The flag alone (the micro-batches before the measuring one), then with the squares.
        names = ["acc", "acc_sr"] if r["dtype"] == "bf16" else ["acc"]
        accumulate = [
            f"{name}{suffix}[{level}]"
            for name in names
            for suffix in ("", "+sumsq")
            for level in levels
        ]
        assert list(r["accumulate_s"]) == [*accumulate, "add_"]
        assert all(all_positive(r[key]) for key in ("update_s", "sumsq_s", "accumulate_s"))
    # Per dtype and size: the update line, sr/nearest for bf16, the sum-of-squares line, the
    # accumulate line and its sr/nearest for bf16.
    tagged = [line.split(":")[0] for line in lines if re.match(r"(bf16|fp32) +\d+K", line)]
    bf16 = ("", " sr/nearest", " sumsq", " accumulate", " accumulate sr/nearest")
    fp32 = ("", " sumsq", " accumulate")
    assert tagged == [
        *(f"bf16   4K{tag}" for tag in bf16),
        *(f"bf16   8K{tag}" for tag in bf16),
        *(f"fp32   4K{tag}" for tag in fp32),
        *(f"fp32   8K{tag}" for tag in fp32),
    ]
    first = result["results"][0]["update_s"]
    cell = re.search(rf"ours\[{levels[0]}\] ([\d.]+)", lines[2]).group(1)
    assert float(cell) == pytest.approx(first[f"ours[{levels[0]}]"] / first["axpy"], abs=6e-4)


def test_cpu_levels_int8_rows(tmp_path, capsys, restore_threads):
    # The 8-bit buffer's pass against the bf16 buffer's, unmeasured and measured, per level:
    # the cells line and the int8/bf16_sr line, each ratio what the JSON's medians give.
    levels = cpp._loader.module("cpu")._cpu_isas()
    argv = ["cpu_levels", "--sizes", "4K", "--dtype", "int8", "--reps", "2"]
    lines, result = run_cli(argv, tmp_path, capsys)
    [r] = result["results"]
    assert (r["dtype"], r["numel"]) == ("int8", 4096)
    keys = [
        f"{name}{suffix}[{level}]"
        for name in ("int8", "bf16_sr")
        for suffix in ("", "+sumsq")
        for level in levels
    ]
    assert list(r["accumulate_s"]) == [*keys, "add_"] and all_positive(r["accumulate_s"])
    tagged = [line.split(":")[0] for line in lines if line.startswith("int8")]
    assert tagged == ["int8   4K accumulate", "int8   4K accumulate int8/bf16_sr"]
    med = r["accumulate_s"]
    ratio = re.search(rf"\+sumsq\[{levels[-1]}\] ([\d.]+)", lines[-1]).group(1)
    expected = med[f"int8+sumsq[{levels[-1]}]"] / med[f"bf16_sr+sumsq[{levels[-1]}]"]
    assert float(ratio) == pytest.approx(expected, abs=6e-4)


def test_accumulate_every_backend_form_and_rounding(tmp_path, capsys, restore_threads):
    # Per dtype and size: the flag-alone and +sumsq passes per backend serving the CPU, to
    # nearest and (bf16) stochastically, against add_; the sr/nearest line what the JSON's
    # medians give.
    argv = ["accumulate", "--sizes", "4K,8K", "--dtype", "bf16,fp32", "--reps", "2"]
    lines, result = run_cli(argv, tmp_path, capsys)
    runs = [(r["dtype"], r["numel"]) for r in result["results"]]
    assert runs == [("bf16", 4096), ("bf16", 8192), ("fp32", 4096), ("fp32", 8192)]
    for r in result["results"]:
        names = ["acc", "acc_sr"] if r["dtype"] == "bf16" else ["acc"]
        keys = [
            f"{name}[{backend}]{suffix}"
            for backend in ("cpp", "torch")
            for name in names
            for suffix in ("", "+sumsq")
        ]
        assert list(r["seconds"]) == [*keys, "add_"] and all_positive(r["seconds"])
    tagged = [line.split(":")[0] for line in lines if re.match(r"(bf16|fp32) +\d+K", line)]
    assert tagged == [
        "bf16   4K", "bf16   4K sr/nearest", "bf16   8K", "bf16   8K sr/nearest",
        "fp32   4K", "fp32   8K",
    ]  # fmt: skip
    med = result["results"][0]["seconds"]
    ratio = re.search(r"\[cpp\]\+sumsq ([\d.]+)", lines[3]).group(1)
    assert float(ratio) == pytest.approx(med["acc_sr[cpp]+sumsq"] / med["acc[cpp]+sumsq"], abs=6e-4)


def test_update_every_case_dtype_and_variant_and_its_targets(tmp_path, capsys, restore_threads):
    argv = ["update", "--numel", "4K", "--reps", "2", "--mix-reps", "1"]
    lines, result = run_cli(argv + ["--mix-layers", "1", "--threads", "1"], tmp_path, capsys)
    seconds = result["seconds"]
    light = ["fused", "fused_plain", "axpy", "fused_sgd", "fused_sgd_amp"]
    expected = {
        "single": light,
        "single_heavy": ["fused", "official", "reference"],
        "mix": light,
        "mix_heavy": ["fused", "official", "reference"],
        "sumsq": ["grad_sumsq", "vector_norm", "reference"],
    }
    assert list(seconds) == list(expected)
    for case, variants in expected.items():
        assert list(seconds[case]) == ["bf16", "fp32"]
        for dtype, timings in seconds[case].items():
            sr = ["fused_sr"] if dtype == "bf16" and case in ("single", "mix") else []
            assert list(timings) == variants + sr and all_positive(timings)
    assert "small-LLaMA mix: 9 tensors, 0.8M elements, one call per tensor" in lines
    # Each target line states the ratio of the medians in the JSON.
    single = seconds["single"]
    ratios = {
        "bf16 fused/axpy": single["bf16"]["fused"] / single["bf16"]["axpy"],
        "fp32 fused/fused_sgd": single["fp32"]["fused"] / single["fp32"]["fused_sgd"],
        "bf16 official/fused": seconds["single_heavy"]["bf16"]["official"]
        / seconds["single_heavy"]["bf16"]["fused"],
    }
    for label, ratio in ratios.items():
        line = next(line for line in lines if line.startswith(f"  {label} "))
        assert float(line.split()[2]) == pytest.approx(ratio, abs=6e-4)
