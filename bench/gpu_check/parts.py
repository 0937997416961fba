"""The parts of `python -m bench.gpu_check`, in order of value: the command lines each runs on
the device, its time budget, and its key figures read back from what the commands wrote.
With --device cpu the same commands run at tiny sizes, one optimizer (or quality row) where
the GPU runs several: every one is a process, and the CPU run is a test.

Budgets, in seconds: 530 of the 540 (9 minutes) that one 10-minute command on a lent GPU
allows with a minute to spare, 10 s left for the machine line and the files; with another
--budget-s, the same shares of it:

    smoke      165  the CUDA extensions' first nvcc build (both at once, a minute or two on a
                    fresh machine) and ~520 tests in pytest-xdist workers
    train-1b   105  seven processes (six optimizers, the forward-backward baseline), each
                    ~10 s of start-up and six 1B steps
    24gib       90  two runs of bench train, each starting two processes (the baseline,
                    Lomo) that build an 8B model; a step of 16K tokens with checkpointing
                    takes seconds
    head        50  one process; liger-kernel and cut-cross-entropy compile their kernels
    host-time   25  two short processes
    accumulate  30  one process: the accumulation's Triton kernels compile (4 forms) and a
                    64M bf16 buffer is timed on both backends
    quality     65  the tiny model's pretraining on the CPU (~30 s, then cached) and 18 short
                    fine-tuning runs, 8 at a time

Each command writes its results as JSON into a scratch folder (the smoke tests' outcomes as
JSON lines, one per test as it ends, so a part killed at its deadline still counts them).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import build, pytest_outcomes

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SMOKE_MARKER = "gpu_smoke"
# Test failures, skip reasons and messages listed in the summary: the log has them all.
MAX_LISTED = 20


@dataclass(frozen=True)
class Command:
    """One command line of a part. `label` names its results among the part's (it prefixes
    their rows where a part has several commands); `output`: the file it writes them to."""

    label: str
    argv: tuple[str, ...]
    output: Path
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Summary:
    """A part's key figures, `figures[row][measure]`, each a finite number > 0 (anything else
    is kept as a note); notes; problems (any: the part failed)."""

    figures: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def add(self, row: str, measure: str, value: Any) -> None:
        if isinstance(value, int | float) and math.isfinite(value) and value > 0:
            self.figures.setdefault(row, {})[measure] = float(value)
        else:
            self.notes.append(f"{row}: {measure} {value}")


@dataclass(frozen=True)
class Part:
    """One part: `commands(device, scratch)` to run in order, `summarize({label: results})`
    for the figures (a label's results are None where its command wrote none)."""

    name: str
    title: str
    budget_s: float
    commands: Callable[[str, Path], list[Command]]
    summarize: Callable[[dict[str, Any]], Summary]


def sizes(device: str) -> str:
    """Which of a part's settings apply: "cuda" (any CUDA device) or "cpu" (tiny sizes)."""
    return "cpu" if device == "cpu" else "cuda"


def bench(study: str, device: str, *arguments: str) -> tuple[str, ...]:
    """The command line of study `study` (bench/<study>.py) on `device`."""
    return (sys.executable, "-m", f"bench.{study}", "--device", device, *arguments)


def load(path: Path) -> Any:
    """A command's results: JSON, or JSON lines (a last line cut short by a kill is left out);
    None where the file was not written."""
    if not path.exists():
        return None
    text = path.read_text()
    if path.suffix != ".jsonl":
        return json.loads(text)
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


# ----------------------------------------------------------------------------- a. smoke


def smoke_files() -> list[str]:
    """The test files that mark tests gpu_smoke (collecting only these saves every worker
    the whole suite's collection); the tests folder where none does."""
    files = [p for p in sorted(TESTS.rglob("test_*.py")) if SMOKE_MARKER in p.read_text()]
    return [str(p.relative_to(ROOT)) for p in files] or [str(TESTS.relative_to(ROOT))]


def xdist_workers(device: str) -> int:
    """pytest-xdist workers for the smoke tests: half the cores up to 8 on a GPU machine
    (Triton's compilations and the float64 references run on the host), none on the CPU (a
    few tests: a worker's start-up would cost more) or without pytest-xdist."""
    import importlib.util

    if sizes(device) == "cpu" or importlib.util.find_spec("xdist") is None:
        return 0
    workers = min(8, (os.cpu_count() or 2) // 2)
    return workers if workers >= 2 else 0


def smoke_commands(device: str, scratch: Path) -> list[Command]:
    built, outcomes = scratch / "extensions.json", scratch / "tests.jsonl"
    workers = xdist_workers(device)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    pytest += ["-p", pytest_outcomes.__name__, "-m", SMOKE_MARKER]
    pytest += ["-n", str(workers)] if workers else []
    return [
        Command(
            "build",
            (sys.executable, "-m", build.__name__, "--device", device, "--json", str(built)),
            built,
        ),
        Command(
            "tests",
            (*pytest, *smoke_files()),
            outcomes,
            {"LOMO_TEST_DEVICE": device, pytest_outcomes.OUTCOMES_ENV: str(outcomes)},
        ),
    ]


def final_outcomes(records: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Each test's outcome and message: the worst of its phases (an error in set-up or
    teardown counts as an error, not a failure)."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    final: dict[str, tuple[str, str]] = {}
    for record in records:
        outcome = record["outcome"]
        if outcome == "failed" and record["when"] != "call":
            outcome = "error"
        seen = final.get(record["test"])
        if seen is None or rank[outcome] > rank[seen[0]]:
            final[record["test"]] = (outcome, record.get("message", ""))
    return final


def summarize_smoke(results: dict[str, Any]) -> Summary:
    summary = Summary()
    built = results.get("build")
    if built is None:
        summary.problems.append("the extension build wrote no results")
    else:
        summary.add("extensions", "build s", built["seconds"])
        for backend, reason in built["unavailable"].items():
            summary.problems.append(f"{backend} unavailable: {reason[:300]}")
    if results.get("tests") is None:
        summary.problems.append("no test outcome was recorded")
        return summary
    outcomes = final_outcomes(results["tests"])
    counts = Counter(outcome for outcome, _ in outcomes.values())
    summary.add("tests", "passed", counts["passed"])
    summary.notes.append(
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
        f"{counts['skipped']} skipped"
    )
    broken = [(t, o, m) for t, (o, m) in outcomes.items() if o in ("failed", "error")]
    if broken:
        summary.problems.append(f"{len(broken)} tests failed or errored")
    summary.notes += [f"{o.upper()} {t}: {m}" for t, o, m in broken[:MAX_LISTED]]
    skipped = Counter(m for o, m in outcomes.values() if o == "skipped")
    summary.notes += [f"skipped ({n}): {m}" for m, n in skipped.most_common(MAX_LISTED)]
    return summary


# ----------------------------------------------------------------------------- b. and c. train

TRAIN_1B = {
    # bench-gpu-train-1b's flags with fewer steps; lomo_compiled_autograd left out (its
    # compilation alone would take the part's budget).
    "cuda": "--model llama-1b --dtype bf16 --seq 2048 --batch 4 --steps 4 --warmup 2 "
    "--optimizers adamw,lomo_optim,lomo,lomo_single,adalomo,adalomo_single",
    "cpu": "--model tiny --dtype fp32 --seq 32 --batch 2 --steps 1 --warmup 1 --optimizers lomo",
}
# bench-gpu-24gib's flags, Lomo alone and one step fewer.
TRAIN_24GIB = {
    "cuda": "--model llama-3-8b --dtype bf16 --seq 2048 --batch 8 --checkpointing "
    "--memory-cap-gib 24 --steps 2 --warmup 1 --optimizers lomo",
    "cpu": "--model tiny --dtype fp32 --seq 32 --batch 2 --checkpointing --memory-cap-gib 24 "
    "--steps 1 --warmup 1 --optimizers lomo",
}


def train_command(label: str, device: str, scratch: Path, flags: str) -> Command:
    output = scratch / f"train-{label or 'run'}.json".replace(" ", "-")
    argv = bench("train", device, *flags.split(), "--no-progress", "--json", str(output))
    return Command(label, argv, output)


def train_1b_commands(device: str, scratch: Path) -> list[Command]:
    return [train_command("", device, scratch, TRAIN_1B[sizes(device)])]


def train_24gib_commands(device: str, scratch: Path) -> list[Command]:
    flags = TRAIN_24GIB[sizes(device)]
    return [
        train_command("fused head", device, scratch, flags + " --fused-head"),
        train_command("unfused", device, scratch, flags),
    ]


def summarize_train(results: dict[str, Any]) -> Summary:
    """Per optimizer (and the forward-backward baseline): tokens/s, median step, peak memory;
    an optimizer out of memory or unavailable is a note (a result, not a failure)."""
    summary = Summary()
    for label, result in results.items():
        if result is None:
            continue
        suffix = f", {label}" if label else ""
        base = result["machine"]["forward_backward"]
        for row in [{**base, "optimizer": "forward + backward"}, *result["results"]]:
            name = row["optimizer"] + suffix
            if row["status"] != "ok":
                summary.notes.append(f"{name}: {row['status']} {row.get('error', '')}".strip())
                continue
            if row["optimizer"] != "forward + backward":
                summary.add(name, "tokens/s", row["tokens_per_s"])
            summary.add(name, "step ms", row["median_step_s"] * 1e3)
            summary.add(name, "peak GiB", row["peak_mib"] / 1024)
    return summary


# ----------------------------------------------------------------------------- d. head

HEAD = {
    "cuda": "--shape llama-3-8b --dtype bf16 --steps 5 --warmup 1",
    "cpu": "--shape small --vocab 2048 --hidden 64 --tokens 128 --dtype fp32 --steps 1 --warmup 1",
}
HEAD_VARIANTS = "unfused,fused_lomo,liger,cce"


def head_commands(device: str, scratch: Path) -> list[Command]:
    output = scratch / "head.json"
    flags = [*HEAD[sizes(device)].split(), "--variants", HEAD_VARIANTS]
    return [Command("", bench("head", device, *flags, "--json", str(output)), output)]


def summarize_head(results: dict[str, Any]) -> Summary:
    """Per variant: the step's time and its tensor peak; a variant not installed, needing
    CUDA or out of memory is a note."""
    summary = Summary()
    if results[""] is None:
        return summary
    for row in results[""]["results"]:
        if row["status"] != "ok":
            summary.notes.append(f"{row['variant']}: {row['status']}")
            continue
        summary.add(row["variant"], "step ms", row["median_step_s"] * 1e3)
        summary.add(row["variant"], "step peak MiB", row["step_peak_bytes"] / 2**20)
    return summary


# ----------------------------------------------------------------------------- e. host time

HOST_TIME = {"cuda": "", "cpu": "--reps 2 --calls 5"}
HOST_TIME_BACKENDS = ("triton", "cpp")


def host_time_commands(device: str, scratch: Path) -> list[Command]:
    commands = []
    for backend in HOST_TIME_BACKENDS:
        output = scratch / f"host-time-{backend}.json"
        flags = [*HOST_TIME[sizes(device)].split(), "--backend", backend, "--json", str(output)]
        commands.append(Command(backend, bench("host_time", device, *flags), output))
    return commands


def summarize_host_time(results: dict[str, Any]) -> Summary:
    """Per backend and way of calling: host time per call, and its ratio to `p.add_`."""
    from ..host_time import FLOOR

    summary = Summary()
    for backend, result in results.items():
        if result is None:
            continue
        per_call = result["seconds_per_call"]
        for way, seconds in per_call.items():
            row = f"{backend}: {way}"
            summary.add(row, "us per call", seconds * 1e6)
            summary.add(row, f"x {FLOOR}", seconds / per_call[FLOOR])
    return summary


# ----------------------------------------------------------------------------- f. accumulate

ACCUMULATE = {"cuda": "--sizes 64M --dtype bf16", "cpu": "--sizes 4K --dtype bf16 --reps 2"}


def accumulate_commands(device: str, scratch: Path) -> list[Command]:
    output = scratch / "accumulate.json"
    flags = [*ACCUMULATE[sizes(device)].split(), "--json", str(output)]
    return [Command("", bench("accumulate", device, *flags), output)]


def summarize_accumulate(results: dict[str, Any]) -> Summary:
    """Per size and variant: its time over `add_`'s; per stochastic variant, its time over the
    round-to-nearest one's (the target: at most 1.05x on a GPU)."""
    summary = Summary()
    if results[""] is None:
        return summary
    for case in results[""]["results"]:
        seconds = case["seconds"]
        for variant, value in seconds.items():
            row = f"{case['dtype']} {case['numel']}: {variant}"
            summary.add(row, "x add_", value / seconds["add_"])
            if variant.startswith("acc_sr"):
                nearest = "acc" + variant.removeprefix("acc_sr")
                summary.add(row, "x nearest", value / seconds[nearest])
    return summary


# ----------------------------------------------------------------------------- g. quality

QUALITY = {
    "cuda": "--rows paper --workers 8",
    "cpu": "--rows paper --optimizers adamw_master --steps 2 --pretrain-steps 2 --workers 2",
}


def quality_commands(device: str, scratch: Path) -> list[Command]:
    output = scratch / "quality.json"
    flags = [*QUALITY[sizes(device)].split(), "--no-progress", "--json", str(output)]
    return [Command("", bench("quality", device, *flags), output)]


def summarize_quality(results: dict[str, Any]) -> Summary:
    """Per row: the held-out loss before and after; the share of the fp32-weights gain kept
    as a note (a share can be zero or negative)."""
    summary = Summary()
    if results[""] is None:
        return summary
    for row in results[""]["rows"]:
        name = f"{row['optimizer']} {row['lr']:g}, {row['label']}"
        summary.add(name, "loss before", row["loss_before"])
        summary.add(name, "loss after", row["loss_after"])
        if row["kept"] is not None and row["rounding"] != "exact":
            summary.notes.append(f"{name}: kept {row['kept']:.0%} of the fp32-weights gain")
    return summary


PARTS: tuple[Part, ...] = (
    Part(
        "smoke",
        "the gpu_smoke tests on the device: every op on every backend against float64, both "
        "optimizers end to end, the logits-free head and embedding rows, stochastic rounding, "
        "compiled autograd, no host sync",
        165,
        smoke_commands,
        summarize_smoke,
    ),
    Part(
        "train-1b",
        "bench train on a 1B LLaMA shape, bf16, 4 x 2048 tokens (tiny on the CPU)",
        105,
        train_1b_commands,
        summarize_train,
    ),
    Part(
        "24gib",
        "bench train on a Llama-3-8B shape, bf16, 8 x 2048 tokens, checkpointing, capped at "
        "24 GiB: Lomo with the fused head, then without (tiny on the CPU)",
        90,
        train_24gib_commands,
        summarize_train,
    ),
    Part(
        "head",
        "bench head on Llama-3-8B's head at 8 x 2048 tokens: unfused, fused with a Lomo owning "
        "W, liger-kernel, cut-cross-entropy (the small shape on the CPU)",
        50,
        head_commands,
        summarize_head,
    ),
    Part(
        "host-time",
        "bench host-time: host time per update call, Triton and C++/CUDA against p.add_",
        25,
        host_time_commands,
        summarize_host_time,
    ),
    Part(
        "accumulate",
        "bench accumulate: gradient accumulation's pass on each backend, to nearest and "
        "stochastic, against b.add_(g)",
        30,
        accumulate_commands,
        summarize_accumulate,
    ),
    Part(
        "quality",
        "bench quality on the device: the share of the fp32-weights gain bf16 and fp16 "
        "weights keep",
        65,
        quality_commands,
        summarize_quality,
    ),
)
