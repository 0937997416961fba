"""`python -m bench.gpu_check`: the package's GPU paths checked in one command that fits one
lent GPU's 10-minute window (9 minutes, the C++/CUDA extensions' first build included).

    python -m bench.gpu_check [--device cuda|cpu] [--results DIR] [--budget-s S]

Parts, in order of value (`parts.py`: what each runs, and why its budget): the gpu_smoke
tests on the device; `bench.train` on a 1B shape; the headline, `bench.train` on a
Llama-3-8B shape capped at 24 GiB with the fused head and without; `bench.head`; `bench.host_time`
; `bench.quality`. Each part runs in processes of its own under its own budget,
its share of --budget-s; a part past its budget is killed (`runner.py`), reported out of
time, and the next one starts. DIR gets summary.md, results.json and gpu-check.log,
rewritten after every part (`report.py`). With --device cpu the same parts run the same
commands at tiny sizes, in a few minutes: tests/benchmarks/test_gpu_check.py runs it. --budget-s
is 540 on the GPU and twice that on the CPU (CPU_BUDGET_S).

Exit status 0 when every part is ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..common import machine
from ..common.argtypes import device, positive_float
from ..common.process import ProcessFailed, child_env, run_isolated
from . import report
from .parts import PARTS, ROOT, Command, Part, Summary, load, sizes
from .runner import Ran, run_commands

# The parts' budgets add up to this less the 10 s the machine line and the files take; with
# another --budget-s each part gets the same share of it.
FULL_BUDGET_S = 540.0
# On the CPU every Triton kernel runs in its interpreter and the machine may be running other
# tests beside it: each part gets twice its GPU share. On a 2-core AVX2 machine with a second
# test worker busy, the slowest parts took 0.9-1.2 of their GPU shares.
CPU_BUDGET_S = 2 * FULL_BUDGET_S
DEFAULT_RESULTS = "bench/results/gpu-check"
MACHINE_TIMEOUT_S = 120


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), None where it cannot be read."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def machine_info(device_name: str) -> dict[str, Any]:
    """`machine.describe` of the device, read in a process of its own (this one never
    touches the device, so it holds none of its memory), and the driver's version."""
    try:
        info = run_isolated(
            machine.describe, {"device": device_name}, metered=False, timeout=MACHINE_TIMEOUT_S
        )
    except (ProcessFailed, subprocess.TimeoutExpired) as exc:
        info = {"device": device_name, "error": str(exc).splitlines()[0]}
    if sizes(device_name) == "cuda":
        info["driver"] = nvidia_driver()
    return info


def machine_line(info: dict[str, Any]) -> str:
    if "error" in info:
        return f"Machine not read: {info['error']}"
    driver = f"; driver {info['driver']}" if info.get("driver") else ""
    return machine.one_line(info) + driver


def status(ran: Ran, problems: list[str]) -> str:
    if ran.out_of_time:
        return "out-of-time"
    return "failed" if ran.failures or problems else "ok"


def read_results(
    part: Part, commands: Sequence[Command], ran: Ran
) -> tuple[dict[str, Any], Summary]:
    """Each command's results and the part's summary of them; a command that ended well
    without writing its results, or results the summary cannot read, are problems."""
    outputs: dict[str, Any] = {}
    problems = []
    for command in commands:
        try:
            outputs[command.label] = load(command.output)
        except ValueError as exc:  # cut short while it was written
            outputs[command.label] = None
            problems.append(f"{command.label or part.name}: unreadable results ({exc})")
        if command.label in ran.finished and outputs[command.label] is None:
            problems.append(f"{command.label or part.name}: ended without writing its results")
    try:
        summary = part.summarize(outputs)
    except Exception as exc:  # a benchmark's JSON changed shape: this part failed, not the run
        summary = Summary(problems=[f"its results could not be read: {exc!r}"])
    summary.problems[:0] = problems
    return outputs, summary


def pending(part: Part, budget_s: float) -> dict[str, Any]:
    """A part's entry in the results before it runs."""
    return {
        "title": part.title,
        "status": "pending",
        "budget_s": budget_s,
        "seconds": 0.0,
        "commands": [],
        "figures": {},
        "problems": [],
        "notes": [],
        "results": {},
    }


def run(
    device_name: str,
    folder: Path,
    budget_s: float = FULL_BUDGET_S,
    parts: Sequence[Part] = PARTS,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every part in order under its budget; the results (as written to `folder`).
    `progress` gets a line as each part starts and ends."""
    began = time.monotonic()
    deadline = began + budget_s
    scale = budget_s / FULL_BUDGET_S
    folder.mkdir(parents=True, exist_ok=True)
    info = machine_info(device_name)
    results: dict[str, Any] = {
        "device": device_name,
        "machine": info,
        "machine_line": machine_line(info),
        "budget_s": budget_s,
        "seconds": 0.0,
        "parts": {part.name: pending(part, part.budget_s * scale) for part in parts},
    }
    progress(results["machine_line"])
    # Triton compiles for the GPU; on CPU tensors it runs only under its interpreter.
    env = child_env(False, {"TRITON_INTERPRET": "1" if sizes(device_name) == "cpu" else "0"})
    (folder / report.LOG).write_text("")
    with (
        open(folder / report.LOG, "a") as output,
        tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch,
    ):
        for part in parts:
            entry = results["parts"][part.name]
            commands = part.commands(device_name, Path(scratch))
            entry.update(status="running", commands=[list(c.argv) for c in commands])
            results["seconds"] = time.monotonic() - began
            report.write(folder, results)
            progress(f"{part.name}: running, budget {entry['budget_s']:.0f} s")
            part_deadline = min(time.monotonic() + entry["budget_s"], deadline)
            ran = run_commands(commands, part_deadline, output, ROOT, env)
            outputs, summary = read_results(part, commands, ran)
            if ran.out_of_time and not ran.started:
                summary.notes.insert(0, "not started: the whole run's budget was spent")
            entry.update(
                status=status(ran, summary.problems),
                seconds=ran.seconds,
                figures=summary.figures,
                problems=ran.failures + summary.problems,
                notes=summary.notes,
                results=outputs,
            )
            results["seconds"] = time.monotonic() - began
            report.write(folder, results)
            progress(f"{part.name}: {entry['status']} in {ran.seconds:.0f} s")
    return results


def results_folder(text: str) -> str:
    """A folder to write into: existing, or creatable under a writable one."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file: give a folder")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{str(existing)!r} is not writable: give another folder")
    return str(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        type=device,
        default="cuda",
        help="cuda (default), or cpu: the same parts at tiny sizes",
    )
    parser.add_argument(
        "--results",
        type=results_folder,
        default=DEFAULT_RESULTS,
        help=f"folder of summary.md, results.json and gpu-check.log (default {DEFAULT_RESULTS})",
    )
    parser.add_argument(
        "--budget-s",
        type=positive_float,
        default=None,
        help="wall-time budget of the whole run in seconds; each part gets its share "
        f"(default {FULL_BUDGET_S:.0f} on the GPU, {CPU_BUDGET_S:.0f} on the CPU)",
    )


def default_budget_s(device_name: str) -> float:
    """The whole run's budget when --budget-s is not given."""
    return FULL_BUDGET_S if sizes(device_name) == "cuda" else CPU_BUDGET_S


def command(args: argparse.Namespace) -> int:
    budget_s = args.budget_s or default_budget_s(args.device)
    results = run(args.device, Path(args.results), budget_s, PARTS)
    print(f"summary: {Path(args.results) / report.SUMMARY}")
    return 0 if all(p["status"] == "ok" for p in results["parts"].values()) else 1
