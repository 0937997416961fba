"""`python -m bench.gpu_check --device cpu`: the GPU check's own code path at tiny sizes, so that
it still works on the rare day a GPU is lent. Every part runs, in order, in processes of its
own; the files it writes (at most 8); each part's status and key figures; a part over its
budget is killed and reported out of time while the next one runs. The GPU's command lines
are checked by the command-line parser (they cannot run here)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.bench_cli import build_parser, main

from bench import gpu_check
from bench.gpu_check import build, parts, report

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="bench train reads /proc/self/status"
)
FILES = {report.SUMMARY, report.RESULTS, report.LOG}
NAMES = [part.name for part in parts.PARTS]
# What the smoke part must run on the device, and the test (marked gpu_smoke) that does.
SMOKE_COVERS = {
    "the LOMO update, every backend, against float64": "test_update_matches_float64_on_cuda",
    "the gradients' sum of squares": "test_grad_sumsq_matches_float64_on_cuda",
    "AdaLomo's statistics pass": "test_adalomo_pass_a_matches_float64_on_cuda",
    "AdaLomo's moments": "test_adalomo_moments_match_float64_on_cuda",
    "stochastic rounding, LOMO": "test_stochastic_rounding_seed_step_read_on_cuda",
    "stochastic rounding, AdaLomo": "test_adalomo_write_back_stochastic_rounding_on_cuda",
    "Lomo against torch's SGD": "test_lomo_fp32_equals_torch_sgd_on_cuda",
    "both optimizers end to end": "test_optimizers_train_on_cuda_without_host_sync",
    "the logits-free head": "test_public_function_matches_unfused_cross_entropy",
    "the head and embedding rows": (
        "test_bf16_head_and_embedding_by_blocks_against_the_materialised_gradients"
    ),
    "compiled autograd": "test_compiled_training_matches_eager[forward_and_compiled_autograd]",
    "no host sync": "test_fast_path_does_not_sync_on_cuda",
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[Path, int]:
    """One whole run into an empty folder, bench quality's pretrained model cached apart."""
    folder = tmp_path_factory.mktemp("gpu_check")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOMO_KERNELS_CACHE", str(tmp_path_factory.mktemp("cache")))
        status = main(["gpu_check", "--device", "cpu", "--results", str(folder)])
    return folder, status


def results_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / report.RESULTS).read_text())


def test_writes_three_files_and_exits_0(checked) -> None:
    folder, status = checked
    assert status == 0, (folder / report.SUMMARY).read_text()
    assert {p.name for p in folder.iterdir()} == FILES  # at most 8; no scratch left behind
    assert all(p.is_file() for p in folder.iterdir())


def test_every_part_ok_with_positive_figures(checked) -> None:
    results = results_of(checked[0])
    assert results["device"] == "cpu" and results["machine"]["cpu_cores"] > 0
    assert list(results["parts"]) == NAMES
    # Without --budget-s the CPU run gets twice the GPU's budget, each part twice its share.
    assert results["budget_s"] == gpu_check.CPU_BUDGET_S == 2 * gpu_check.FULL_BUDGET_S
    budgets = {part.name: 2 * part.budget_s for part in parts.PARTS}
    assert {name: part["budget_s"] for name, part in results["parts"].items()} == budgets
    for name, part in results["parts"].items():
        assert part["status"] == "ok", (name, part["problems"], part["notes"])
        assert part["problems"] == []
        assert 0 < part["seconds"] <= part["budget_s"]
        assert part["commands"] and part["results"]
        assert part["figures"], name
        for row, values in part["figures"].items():
            for measure, value in values.items():
                assert math.isfinite(value) and value > 0, (name, row, measure, value)


def test_figures_come_from_each_benchmark(checked) -> None:
    figures = {name: part["figures"] for name, part in results_of(checked[0])["parts"].items()}
    tests = results_of(checked[0])["parts"]["smoke"]["results"]["tests"]
    passed = {r["test"] for r in tests if r["when"] == "call" and r["outcome"] == "passed"}
    assert figures["smoke"]["tests"]["passed"] == len(passed) >= 1
    assert figures["smoke"]["extensions"]["build s"] > 0
    assert {"tokens/s", "step ms", "peak GiB"} <= set(figures["train-1b"]["lomo"])
    assert {"lomo, fused head", "lomo, unfused"} <= set(figures["24gib"])
    # Each row is its own run: the fused head's with the fused head, the other without.
    runs = results_of(checked[0])["parts"]["24gib"]["results"]
    assert [runs[label]["machine"]["fused_head"] for label in ("fused head", "unfused")] == [
        True,
        False,
    ]
    assert {"unfused", "fused_lomo"} <= set(figures["head"])  # liger and cce need CUDA
    for backend in parts.HOST_TIME_BACKENDS:
        assert figures["host-time"][f"{backend}: p.add_"]["x p.add_"] == 1.0
    assert figures["accumulate"]["bf16 4096: add_"]["x add_"] == 1.0
    assert "x nearest" in figures["accumulate"]["bf16 4096: acc_sr[cpp]"]
    assert all({"loss before", "loss after"} <= set(v) for v in figures["quality"].values())


def test_the_smoke_part_selects_every_gpu_path(checked) -> None:
    """Selected here too (skipped without CUDA): the same selection as on the GPU."""
    records = results_of(checked[0])["parts"]["smoke"]["results"]["tests"]
    selected = {record["test"].split("::", 1)[1] for record in records}
    missing = {
        what: test
        for what, test in SMOKE_COVERS.items()
        if not any(name == test or name.startswith(test + "[") for name in selected)
    }
    assert not missing


def test_summary_has_the_machine_and_every_part_with_its_status(checked) -> None:
    summary = (checked[0] / report.SUMMARY).read_text()
    results = results_of(checked[0])
    assert results["machine_line"].startswith("CPU ") and results["machine_line"] in summary
    sections = summary.split("\n## ")[1:]
    assert [section.splitlines()[0] for section in sections] == NAMES
    for section in sections:
        assert "\n**ok**, " in section
        assert "\n| | " in section  # the key figures' table


def test_a_part_over_its_budget_is_out_of_time_and_the_next_still_runs(
    monkeypatch, tmp_path
) -> None:
    by_name = {part.name: part for part in parts.PARTS}
    # Python's start alone takes longer than this budget.
    over = dataclasses.replace(by_name["host-time"], budget_s=0.5)
    monkeypatch.setattr(gpu_check, "PARTS", (over, by_name["head"]))
    assert main(["gpu_check", "--device", "cpu", "--results", str(tmp_path)]) == 1
    results = results_of(tmp_path)
    killed, after = results["parts"]["host-time"], results["parts"]["head"]
    assert killed["status"] == "out-of-time"
    assert 0.5 <= killed["seconds"] < 5  # killed at its deadline, not run to its end
    assert all(value is None for value in killed["results"].values())
    assert after["status"] == "ok" and after["figures"]
    assert "## host-time" in (tmp_path / report.SUMMARY).read_text()
    assert "**out-of-time**" in (tmp_path / report.SUMMARY).read_text()
    assert "[killed: the part's deadline" in (tmp_path / report.LOG).read_text()


def test_the_gpu_command_lines_parse(monkeypatch, tmp_path) -> None:
    """Every benchmark command a GPU run makes is accepted by the CLI's parser (flags and
    values), as is the extension build's."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for part in parts.PARTS:
        for command in part.commands("cuda", tmp_path):
            module = command.argv[2]
            if module == build.__name__:
                assert build.parser().parse_args(list(command.argv[3:])).device == "cuda"
            elif module.startswith("bench."):
                args = build_parser(module.removeprefix("bench.")).parse_args(command.argv[3:])
                assert args.device == "cuda"
            else:
                assert module == "pytest"
                assert "-m" in command.argv and parts.SMOKE_MARKER in command.argv
                assert command.env["LOMO_TEST_DEVICE"] == "cuda"


def test_budgets_fit_the_command_window() -> None:
    """The parts' budgets leave room for the machine line and the files within 540 s."""
    total = sum(part.budget_s for part in parts.PARTS)
    assert total <= gpu_check.FULL_BUDGET_S - 5
    assert [part.name for part in parts.PARTS][0] == "smoke"


def test_a_test_counts_as_its_worst_phase() -> None:
    records = [
        {"test": "a", "when": "call", "outcome": "passed"},
        {"test": "a", "when": "teardown", "outcome": "failed", "message": "leak"},
        {"test": "b", "when": "setup", "outcome": "skipped", "message": "no GPU"},
        {"test": "c", "when": "call", "outcome": "failed", "message": "wrong"},
        {"test": "d", "when": "call", "outcome": "passed"},
    ]
    assert parts.final_outcomes(records) == {
        "a": ("error", "leak"),
        "b": ("skipped", "no GPU"),
        "c": ("failed", "wrong"),
        "d": ("passed", ""),
    }
    summary = parts.summarize_smoke({"build": None, "tests": records})
    assert summary.figures == {"tests": {"passed": 1.0}}
    assert any("2 tests failed" in problem for problem in summary.problems)
    assert "FAILED c: wrong" in summary.notes and "ERROR a: leak" in summary.notes


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget-s", "0"], "--budget-s: got '0': give a finite number > 0"),
        (["--results", "summary.md"], "'summary.md' is a file: give a folder"),
        (["--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_bad_values_are_refused_before_any_work(capsys, monkeypatch, tmp_path, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "summary.md").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["gpu_check", "--device", "cpu", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["summary.md"]
