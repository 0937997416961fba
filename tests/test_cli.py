"""The command lines: a bad value is refused before any work, in one stderr line, status 2."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from lomo_kernels import demo
from lomo_kernels.tools import bench_kernels, bench_memory, bench_train
from lomo_kernels.tools.cli import main


@pytest.fixture
def no_work(monkeypatch):
    """Any benchmark or training that starts fails the test: refusals come first."""

    def started(*args, **kwargs):
        raise AssertionError("work started before the arguments were refused")

    monkeypatch.setattr(bench_kernels, "run", started)
    monkeypatch.setattr(bench_memory, "run", started)
    monkeypatch.setattr(bench_train, "run", started)
    monkeypatch.setattr(demo, "run", started)


def refusal(capsys, argv: list[str], entry=main) -> str:
    """The one stderr line of a refused command line (status 2, no traceback, no stdout)."""
    with pytest.raises(SystemExit) as exc:
        entry(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert "Traceback" not in err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


MISSING = "no-such-folder/out"
BAD_VALUES = {
    "estimate": [
        (["--gpu-mem", "0"], "--gpu-mem: got '0': give a finite number > 0"),
        (["--gpu-mem", "-5"], "--gpu-mem: got '-5'"),
        (["--gpu-mem", "nan"], "--gpu-mem: got 'nan'"),
        (["--gpu-mem", "inf"], "--gpu-mem: got 'inf'"),
        (["--gpu-mem", "lots"], "--gpu-mem: got 'lots'"),
        (["--gpu-mem", "nan", "--json"], "--gpu-mem: got 'nan'"),
        (["--activations-gib", "-3"], "--activations-gib: got '-3': give a finite number >= 0"),
        (["--activations-gib", "nan"], "--activations-gib: got 'nan'"),
        (["--gpus", "0"], "--gpus: got '0': give a whole number >= 1"),
        (["--batch", "0"], "--batch: got '0'"),
        (["--seq", "-1"], "--seq: got '-1'"),
        (["--seq", "1.5"], "--seq: got '1.5'"),
        (["--model", "llama-3b"], "--model: unknown model 'llama-3b': use a preset (llama-7b"),
    ],
    "bench kernels": [
        (["--device", "tpu"], "unknown device 'tpu': give cpu, cuda or cuda:N"),
        (["--device", "cuda:x"], "unknown device 'cuda:x'"),
        (["--threads", "0"], "--threads: got '0': give a whole number >= 1"),
        (["--threads", "two"], "--threads: got 'two'"),
        (["--budget", "-1"], "--budget: got '-1': give a finite number > 0"),
        (["--budget", "0"], "--budget: got '0'"),
        (["--budget", "nan"], "--budget: got 'nan'"),
        (["--csv", f"{MISSING}/rows.csv"], "folder 'no-such-folder/out' of"),
        (["--json", f"{MISSING}/rows.json"], "does not exist: create it or pick another path"),
        (["--plot", f"{MISSING}/plot.png"], "--plot: folder 'no-such-folder/out'"),
        (["--dtype", "bf8"], "--dtype: unknown 'bf8': give a comma list of bf16, fp16, fp32"),
        (["--dtype", ","], "--dtype: empty list"),
        (["--sizes", "0"], "size must be positive"),
        (["--sizes", "4Q"], "bad size '4Q'"),
        (["--sizes", ","], "no size in ','"),
    ],
    "bench memory": [
        (["--batch", "0"], "--batch: got '0'"),
        (["--seq", "0"], "--seq: got '0'"),
        (["--steps", "1"], "--steps: got '1': give a whole number >= 2"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--json", f"{MISSING}/memory.json"], "--json: folder"),
        (["--plot", f"{MISSING}/memory.png"], "--plot: folder"),
        (["--optimizers", "adam"], "--optimizers: unknown 'adam'"),
        (["--model", "llama-3b"], "unknown model 'llama-3b'"),
    ],
    "bench train": [
        (["--batch", "0"], "--batch: got '0'"),
        (["--seq", "0"], "--seq: got '0'"),
        (["--steps", "0"], "--steps: got '0': give a whole number >= 1"),
        (["--warmup", "0"], "--warmup: got '0': give a whole number >= 1"),
        (["--threads", "0"], "--threads: got '0'"),
        (["--clip-grad-norm", "-1"], "--clip-grad-norm: got '-1': give a finite number >= 0"),
        (["--clip-grad-norm", "nan"], "--clip-grad-norm: got 'nan'"),
        (["--dtype", "fp8"], "--dtype: invalid choice: 'fp8'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--json", f"{MISSING}/train.json"], "--json: folder"),
        (["--plot", f"{MISSING}/train.png"], "--plot: folder"),
        (["--optimizers", "adam"], "--optimizers: unknown 'adam'"),
        (["--model", "llama-3b"], "unknown model 'llama-3b'"),
    ],
    "demo": [
        (["--batch", "0"], "--batch: got '0': give a whole number >= 1"),
        (["--seq", "0"], "--seq: got '0': give a whole number 2 to 512"),
        (["--seq", "1"], "--seq: got '1'"),
        (["--seq", "513"], "--seq: got '513'"),
        (["--steps", "0"], "--steps: got '0'"),
        (["--threads", "0"], "--threads: got '0'"),
        (["--lr", "0"], "--lr: got '0'"),
        (["--lr", "nan"], "--lr: got 'nan'"),
        (["--clip-grad-norm", "-1"], "--clip-grad-norm: got '-1'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--plot", f"{MISSING}/demo.png"], "--plot: folder"),
        (["--optimizers", "lomo,adam"], "--optimizers: unknown 'adam'"),
        (["--optimizers", "lomo_optim"], "--optimizers: unknown 'lomo_optim'"),
    ],
}
ESTIMATE_REQUIRED = ["--model", "llama-7b", "--optimizer", "lomo"]
CASES = [
    pytest.param(command, argv, message, id=f"{command} {' '.join(argv)}")
    for command, cases in BAD_VALUES.items()
    for argv, message in cases
]


def command_line(command: str, argv: list[str]) -> list[str]:
    return command.split() + (ESTIMATE_REQUIRED if command == "estimate" else []) + argv


@pytest.mark.parametrize(("command", "argv", "message"), CASES)
def test_bad_value_is_refused_in_one_line(
    capsys, monkeypatch, tmp_path, no_work, command, argv, message
):
    monkeypatch.chdir(tmp_path)  # relative output paths land here, if anything is written
    line = refusal(capsys, command_line(command, argv))
    assert message in line
    assert line.startswith("lomo-kernels")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["bench kernels", "bench memory", "bench train", "demo"])
def test_cuda_without_a_device(capsys, monkeypatch, no_work, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = refusal(capsys, command_line(command, ["--device", "cuda"]))
    assert "'cuda': no CUDA device here; run with --device cpu" in line


def test_cuda_index_past_the_devices(capsys, monkeypatch, no_work):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    line = refusal(capsys, ["bench", "kernels", "--device", "cuda:2"])
    assert "has 2 CUDA device(s); give cuda:0 to cuda:1" in line


def test_output_path_that_is_a_folder(capsys, tmp_path, no_work):
    line = refusal(capsys, ["bench", "kernels", "--csv", str(tmp_path)])
    assert "is a folder: give a file name inside it" in line


def test_output_folder_not_writable(capsys, monkeypatch, tmp_path, no_work):
    # Permission bits do not stop root: the access check itself is what is under test.
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: p != tmp_path and access(p, mode))
    line = refusal(capsys, ["bench", "kernels", "--json", str(tmp_path / "rows.json")])
    assert "is not writable: pick another path" in line


def test_plot_without_matplotlib(capsys, monkeypatch, tmp_path, no_work):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a),
    )
    line = refusal(capsys, ["demo", "--plot", str(tmp_path / "demo.png")])
    assert "plots need matplotlib: pip install matplotlib" in line


def test_valid_values_reach_the_command(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(bench_kernels, "run", lambda *a, **k: seen.update(run=a) or ([], {}))
    monkeypatch.setattr(bench_kernels, "format_table", lambda rows, meta: "")
    monkeypatch.setattr(bench_kernels, "write_csv", lambda rows, path: seen.update(csv=path))
    argv = ["bench", "kernels", "--dtype", "FP32", "--sizes", "4K,1M", "--threads", "1"]
    assert main(argv + ["--csv", str(tmp_path / "rows.csv")]) == 0
    assert seen == {"run": ("cpu", ["fp32"], [4096, 2**20]), "csv": str(tmp_path / "rows.csv")}


def test_demo_own_parser_refuses_in_one_line(capsys, no_work):
    line = refusal(capsys, ["--batch", "0"], entry=demo.main)
    assert (
        line
        == "python -m lomo_kernels.demo: error: argument --batch: got '0': give a whole number >= 1"
    )


def test_demo_module_refuses_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "lomo_kernels.demo", "--steps", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "python -m lomo_kernels.demo: error: argument --steps: got '0': give a whole number >= 1"
    ]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_demo_through_the_cli_exits_0(capsys, restore_threads, monkeypatch, tmp_path):
    monkeypatch.setenv("LOMO_KERNELS_CACHE", str(tmp_path))  # a fresh pretrained checkpoint
    argv = ["demo", "--steps", "2", "--size", "tiny", "--batch", "2", "--seq", "16"]
    assert main(argv + ["--pretrain-steps", "2", "--optimizers", "lomo", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "bf16 weights, computed" in out
    assert "| lomo | 2 | 0.01 | bf16, stochastic (default) |" in out
    assert "| lomo | 2 | 0.01 | fp32 weights |" in out
    assert "lomo: keeps" in out
    assert list((tmp_path / "quality").glob("pretrained-tiny-*.pt"))


@pytest.mark.parametrize(
    ("native", "note"), [(False, "computed fp32 (upcast)"), (True, "computed native")]
)
def test_demo_says_how_bf16_weights_compute(monkeypatch, native, note):
    from lomo_kernels.tools import machine

    monkeypatch.setattr(machine, "native_bf16_matmul", lambda device="cpu": native)
    parser = demo.Parser()
    demo.add_arguments(parser)
    assert note in demo.banner(parser.parse_args([]))


def test_model_config_missing_a_field(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    line = refusal(capsys, ["estimate", "--model", str(tmp_path), "--optimizer", "lomo"])
    assert "missing vocab_size" in line
