"""The package's command line (`lomo-kernels`): estimate and env; a bad value is refused
before any work, in one stderr line, status 2."""

from __future__ import annotations

import json

import pytest
from support.refusals import refusal

from lomo_kernels.tools import env
from lomo_kernels.tools.cli import COMMANDS, main

WHOLE, POSITIVE, NON_NEGATIVE = (
    "give a whole number >= 1",
    "give a finite number > 0",
    "give a finite number >= 0",
)


def got(flag: str, *values: str, hint: str = "") -> list[tuple[list[str], str]]:
    """`flag` given each of `values`, refused with "FLAG: got 'VALUE'" (the first with
    ": `hint`" after it, where given)."""
    return [
        ([flag, value], f"{flag}: got '{value}'" + (f": {hint}" if hint and i == 0 else ""))
        for i, value in enumerate(values)
    ]


ESTIMATE_REQUIRED = ["--model", "llama-7b", "--optimizer", "lomo"]
BAD_ESTIMATES = [
    *got("--gpu-mem", "0", "-5", "nan", "inf", "lots", hint=POSITIVE),
    (["--gpu-mem", "nan", "--json"], "--gpu-mem: got 'nan'"),
    *got("--activations-gib", "-3", "nan", hint=NON_NEGATIVE),
    *got("--gpus", "0", hint=WHOLE),
    *got("--batch", "0"),
    *got("--seq", "-1", "1.5"),
    (["--model", "llama-3b"], "--model: unknown model 'llama-3b': use a preset (llama-7b"),
]


@pytest.mark.parametrize(
    ("argv", "message"), BAD_ESTIMATES, ids=[" ".join(a) for a, _ in BAD_ESTIMATES]
)
def test_bad_estimate_value_is_refused_in_one_line(capsys, argv, message):
    line = refusal(capsys, ["estimate", *ESTIMATE_REQUIRED, *argv], entry=main)
    assert line.startswith("lomo-kernels estimate: error: ")
    assert message in line


def test_model_config_missing_a_field(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    line = refusal(capsys, ["estimate", "--model", str(tmp_path), "--optimizer", "lomo"], main)
    assert "missing vocab_size" in line


def test_the_package_runs_estimate_and_env_only():
    """The benchmarks, the GPU check and the demo run from a clone (bench/), not from here."""
    assert sorted(COMMANDS) == ["env", "estimate"]


def test_env_reports_versions_cpu_bf16_and_backends(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] and info["cpu_isa"] == env.vector_isa()
    assert isinstance(info["bf16_matmul_native_on_cpu"], bool)
    cpu = info["backends"]["cpu"]
    assert set(cpu) == {"lomo", "adalomo"}
    assert all(cpu[family]["torch"] == "loads" for family in cpu)  # the reference always loads
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert "bf16 matmul" in text and "cpu lomo backends, in order: cpp" in text
