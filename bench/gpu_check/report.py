"""What `python -m bench.gpu_check` writes into its results folder, rewritten whole after every
part so that a run cut short still leaves what it had:

    summary.md     the machine line, then one section per part: status, time, key figures
    results.json   the same and every command's own results (the benchmarks' JSON)
    gpu-check.log  every command line and its output, as it comes

A part's status is pending, running, then ok, failed or out-of-time.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

SUMMARY, RESULTS, LOG = "summary.md", "results.json", "gpu-check.log"
FINAL_STATUSES = ("ok", "failed", "out-of-time")


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file, so a reader never sees half of it."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def write(folder: Path, results: dict[str, Any]) -> None:
    write_atomically(folder / RESULTS, json.dumps(results, indent=1) + "\n")
    write_atomically(folder / SUMMARY, summary(results))


def shown(argv: list[str]) -> str:
    """A command line as a reader would type it (`python` for this interpreter's path)."""
    return shlex.join(["python" if arg == sys.executable else arg for arg in argv])


def figures_table(figures: dict[str, dict[str, float]]) -> list[str]:
    """Rows by measures; a measure a row lacks is left blank."""
    measures = list(dict.fromkeys(m for values in figures.values() for m in values))
    lines = ["| | " + " | ".join(measures) + " |", "|---" * (len(measures) + 1) + "|"]
    for row, values in figures.items():
        cells = [_number(values[m]) if m in values else "" for m in measures]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def part_section(name: str, part: dict[str, Any]) -> list[str]:
    lines = [f"## {name}", "", part["title"] + ".", ""]
    status = f"**{part['status']}**"
    if part["status"] in FINAL_STATUSES:
        status += f", {part['seconds']:.0f} s of its {part['budget_s']:.0f} s budget"
    lines += [status, ""]
    if part["figures"]:
        lines += [*figures_table(part["figures"]), ""]
    lines += [f"- **problem**: {problem}" for problem in part["problems"]]
    lines += [f"- {note}" for note in part["notes"]]
    if part["problems"] or part["notes"]:
        lines.append("")
    if part["commands"]:
        lines += ["```bash", *(shown(argv) for argv in part["commands"]), "```", ""]
    return lines


def summary(results: dict[str, Any]) -> str:
    parts = results["parts"]
    done = sum(part["status"] in FINAL_STATUSES for part in parts.values())
    ok = sum(part["status"] == "ok" for part in parts.values())
    lines = [
        f"# gpu-check on {results['device']}",
        "",
        results["machine_line"],
        "",
        f"{done} of {len(parts)} parts done ({ok} ok) in {results['seconds']:.0f} s of the "
        f"{results['budget_s']:.0f} s budget. Every command's results: {RESULTS}; its "
        f"output: {LOG}.",
        "",
    ]
    for name, part in parts.items():
        lines += part_section(name, part)
    return "\n".join(lines)
