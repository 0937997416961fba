"""The studies' command lines (python -m bench.<study>): a bad value is refused before any
work, in one stderr line, status 2."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.bench_cli import build_parser, main
from support.refusals import refusal

from bench import demo
from bench import kernels as bench_kernels
from bench import memory as bench_memory
from bench import train as bench_train


@pytest.fixture
def no_work(monkeypatch):
    """Any benchmark or training that starts fails the test: refusals come first."""

    def started(*args, **kwargs):
        raise AssertionError("work started before the arguments were refused")

    monkeypatch.setattr(bench_kernels, "run", started)
    monkeypatch.setattr(bench_memory, "run", started)
    monkeypatch.setattr(bench_train, "run", started)
    monkeypatch.setattr(demo, "run", started)


MISSING = "no-such-folder/out"


def got(flag: str, *values: str, hint: str = "") -> list[tuple[list[str], str]]:
    """`flag` given each of `values`, refused with "FLAG: got 'VALUE'" (the first with
    ": `hint`" after it, where given)."""
    return [
        ([flag, value], f"{flag}: got '{value}'" + (f": {hint}" if hint and i == 0 else ""))
        for i, value in enumerate(values)
    ]


def says(flag: str, messages: dict[str, str]) -> list[tuple[list[str], str]]:
    """`flag` given each value of `messages`, refused with (a line holding) its message."""
    return [([flag, value], message) for value, message in messages.items()]


WHOLE, POSITIVE, NON_NEGATIVE = (
    "give a whole number >= 1",
    "give a finite number > 0",
    "give a finite number >= 0",
)
UNKNOWN_DEVICE = (["--device", "tpu"], "unknown device 'tpu'")
# Cases every training benchmark shares.
BATCH_AND_SEQ = [*got("--batch", "0"), *got("--seq", "0")]
OPTIMIZERS_AND_MODEL = [
    (["--optimizers", "adam"], "--optimizers: unknown 'adam'"),
    (["--model", "llama-3b"], "unknown model 'llama-3b'"),
]


def outputs(stem: str) -> list[tuple[list[str], str]]:
    """--json and --plot files in a folder that does not exist."""
    return [
        (["--json", f"{MISSING}/{stem}.json"], "--json: folder"),
        (["--plot", f"{MISSING}/{stem}.png"], "--plot: folder"),
    ]


BAD_VALUES = {
    "kernels": [
        *says(
            "--device",
            {
                "tpu": "unknown device 'tpu': give cpu, cuda or cuda:N",
                "cuda:x": "unknown device 'cuda:x'",
            },
        ),
        *got("--threads", "0", "two", hint=WHOLE),
        *got("--budget", "-1", "0", "nan", hint=POSITIVE),
        (["--csv", f"{MISSING}/rows.csv"], "folder 'no-such-folder/out' of"),
        (["--json", f"{MISSING}/rows.json"], "does not exist: create it or pick another path"),
        (["--plot", f"{MISSING}/plot.png"], "--plot: folder 'no-such-folder/out'"),
        *says(
            "--dtype",
            {
                "bf8": "--dtype: unknown 'bf8': give a comma list of bf16, fp16, fp32",
                ",": "--dtype: empty list",
            },
        ),
        *says(
            "--sizes", {"0": "size must be positive", "4Q": "bad size '4Q'", ",": "no size in ','"}
        ),
    ],
    "memory": [
        *BATCH_AND_SEQ,
        *got("--steps", "1", hint="give a whole number >= 2"),
        UNKNOWN_DEVICE,
        *outputs("memory"),
        *OPTIMIZERS_AND_MODEL,
    ],
    "train": [
        *BATCH_AND_SEQ,
        *got("--steps", "0", hint=WHOLE),
        *got("--warmup", "0", hint=WHOLE),
        *got("--threads", "0"),
        *got("--clip-grad-norm", "-1", "nan", hint=NON_NEGATIVE),
        (["--dtype", "fp8"], "--dtype: invalid choice: 'fp8'"),
        UNKNOWN_DEVICE,
        *outputs("train"),
        *OPTIMIZERS_AND_MODEL,
    ],
    "demo": [
        *got("--batch", "0", hint=WHOLE),
        *got("--seq", "0", "1", "513", hint="give a whole number 2 to 512"),
        *got("--steps", "0"),
        *got("--threads", "0"),
        *got("--lr", "0", "nan"),
        *got("--clip-grad-norm", "-1"),
        UNKNOWN_DEVICE,
        (["--plot", f"{MISSING}/demo.png"], "--plot: folder"),
        *says(
            "--optimizers",
            {
                "lomo,adam": "--optimizers: unknown 'adam'",
                "lomo_optim": "--optimizers: unknown 'lomo_optim'",
            },
        ),
    ],
}
CASES = [
    pytest.param(command, argv, message, id=f"{command} {' '.join(argv)}")
    for command, cases in BAD_VALUES.items()
    for argv, message in cases
]


def command_line(command: str, argv: list[str]) -> list[str]:
    return [command, *argv]


@pytest.mark.parametrize(("command", "argv", "message"), CASES)
def test_bad_value_is_refused_in_one_line(
    capsys, monkeypatch, tmp_path, no_work, command, argv, message
):
    monkeypatch.chdir(tmp_path)  # relative output paths land here, if anything is written
    line = refusal(capsys, command_line(command, argv))
    assert message in line
    assert line.startswith(f"python -m bench.{command}: error: ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["kernels", "memory", "train", "demo"])
def test_cuda_without_a_device(capsys, monkeypatch, no_work, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = refusal(capsys, command_line(command, ["--device", "cuda"]))
    assert "'cuda': no CUDA device here; run with --device cpu" in line


def test_cuda_index_past_the_devices(capsys, monkeypatch, no_work):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    line = refusal(capsys, ["kernels", "--device", "cuda:2"])
    assert "has 2 CUDA device(s); give cuda:0 to cuda:1" in line


def test_output_path_that_is_a_folder(capsys, tmp_path, no_work):
    line = refusal(capsys, ["kernels", "--csv", str(tmp_path)])
    assert "is a folder: give a file name inside it" in line


def test_output_folder_not_writable(capsys, monkeypatch, tmp_path, no_work):
    # Permission bits do not stop root: the access check itself is what is under test.
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: p != tmp_path and access(p, mode))
    line = refusal(capsys, ["kernels", "--json", str(tmp_path / "rows.json")])
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
    argv = ["kernels", "--dtype", "FP32", "--sizes", "4K,1M", "--threads", "1"]
    assert main(argv + ["--csv", str(tmp_path / "rows.csv")]) == 0
    assert seen == {"run": ("cpu", ["fp32"], [4096, 2**20]), "csv": str(tmp_path / "rows.csv")}


def test_demo_refuses_in_one_line(capsys, no_work):
    line = refusal(capsys, ["demo", "--batch", "0"])
    assert (
        line == "python -m bench.demo: error: argument --batch: got '0': give a whole number >= 1"
    )


def test_demo_module_refuses_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.demo", "--steps", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "python -m bench.demo: error: argument --steps: got '0': give a whole number >= 1"
    ]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_demo_through_the_cli_exits_0(capsys, restore_threads, monkeypatch, tmp_path):
    monkeypatch.setenv("LOMO_KERNELS_CACHE", str(tmp_path))  # a fresh pretrained checkpoint
    argv = ["demo", "--steps", "2", "--size", "tiny", "--batch", "2", "--seq", "16"]
    argv += ["--pretrain-steps", "2", "--optimizers", "lomo,adamw_master", "--workers", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "bf16 weights, computed" in out
    for phase in ("phase 1/3", "phase 2/3", "pretraining the tiny model", "phase 3/3"):
        assert phase in out
    assert "[4/4]" in out and "learning rates: the papers'" in out
    assert "| lomo | 2 | 0.01 | bf16, stochastic (default) |" in out
    assert "| lomo | 2 | 0.01 | fp32 weights |" in out
    assert "lomo: keeps" in out
    assert "What LOMO buys: memory." in out and "AdamW with fp32 master weights fits up to" in out
    assert "What it costs:" in out
    assert list((tmp_path / "quality").glob("pretrained-tiny-*.pt"))


def test_demo_takes_each_optimizers_best_rate_from_the_sweep(monkeypatch, tmp_path):
    swept = {
        "setup": {"size": "tiny", "steps": 100, "batch": 4, "seq": 64, "weights": "bf16"},
        "optimizers": {
            "lomo": {"lr": 0.03},
            "adalomo": {"lr": 0.003},
            "adamw_master": {"lr": 0.01},
        },
    }
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(swept))
    monkeypatch.setattr(demo, "LEARNING_RATES", path)
    rates, source = demo.learning_rates(build_parser("demo").parse_args([]))
    assert "sweep" in source
    assert rates["lomo"] == rates["lomo_single"] == rates["sgd"] == 0.03
    assert rates["adalomo"] == rates["adalomo_single"] == 0.003 and rates["adamw_master"] == 0.01
    # Another set-up than the sweep's: the papers' rates, said so.
    rates, source = demo.learning_rates(build_parser("demo").parse_args(["--steps", "20"]))
    assert "papers'" in source and rates["lomo"] == 0.01
    rates, _ = demo.learning_rates(build_parser("demo").parse_args(["--lr", "0.5"]))
    assert set(rates.values()) == {0.5}


def test_the_shipped_rates_and_checkpoint_are_the_demos():
    """The demo's defaults find the sweep's rates and the shipped checkpoint (a few MB, loaded
    with weights_only=True into the demo's model)."""
    from bench import quality
    from bench.common.char_model import build_model

    args = build_parser("demo").parse_args([])
    assert "sweep" in demo.learning_rates(args)[1]
    name = quality.checkpoint_name(args.size, {**quality.PRETRAIN, "seed": args.seed})
    path = quality.SHIPPED / name
    assert path.is_file() and path.stat().st_size < 4e6
    state = torch.load(path, weights_only=True)
    build_model(args.size, torch.float32, 0).load_state_dict(state)


@pytest.mark.parametrize(
    ("native", "note"), [(False, "computed fp32 (upcast)"), (True, "computed native")]
)
def test_demo_says_how_bf16_weights_compute(monkeypatch, native, note):
    from bench.common import machine

    monkeypatch.setattr(machine, "native_bf16_matmul", lambda device="cpu": native)
    assert note in demo.banner(build_parser("demo").parse_args([]))


def test_the_machine_line_says_how_bf16_matmuls_run(monkeypatch) -> None:
    """A cap (ONEDNN_MAX_CPU_ISA=AVX2) leaves the CPU's flags offering AVX-512 BF16 while torch
    runs bf16 matmuls through its fallback: the header says what torch does, not the flags."""
    from bench.common import machine

    for native, said in ((True, "bf16 matmul native"), (False, "bf16 matmul emulated")):
        monkeypatch.setattr(machine, "native_bf16_matmul", lambda device="cpu", n=native: n)
        info = machine.describe("cpu")
        assert info["bf16_matmul_native"] is native
        assert said in machine.one_line(info)
