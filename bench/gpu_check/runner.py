"""A part's command lines, one after another, each in a process group of its own that is
killed whole at the part's deadline; their output appended to one log as it comes.

`bench.common.process.run_isolated` runs one function for its JSON answer; a part is a whole
command (pytest and its workers, a benchmark and the processes it starts), so the group
goes, and nothing a killed part started keeps the device busy for the next one.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .parts import Command


@dataclass
class Ran:
    """How a part's commands went: its wall time, whether its deadline cut it short, how
    many commands started, the labels of those that exited well, and why the others failed."""

    seconds: float = 0.0
    out_of_time: bool = False
    started: int = 0
    finished: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def _kill_group(pid: int) -> None:
    """Kills the process group that the command `pid` leads (it and everything it started)."""
    with contextlib.suppress(ProcessLookupError):  # the group has already ended
        os.killpg(pid, signal.SIGKILL)


def run_commands(
    commands: Sequence[Command],
    deadline: float,
    log: IO[str],
    cwd: Path,
    env: Mapping[str, str],
) -> Ran:
    """Runs `commands` in order until `deadline` (time.monotonic()); a command that fails
    does not stop the ones after it, the deadline stops all."""
    ran = Ran()
    began = time.monotonic()
    for command in commands:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            ran.out_of_time = True
            break
        log.write(f"\n$ {shlex.join(command.argv)}\n")
        log.flush()
        ran.started += 1
        proc = subprocess.Popen(
            command.argv,
            cwd=cwd,
            env={**env, **command.env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            ran.out_of_time = True
            log.write(f"\n[killed: the part's deadline, {time.monotonic() - began:.0f} s]\n")
            break
        finally:
            _kill_group(proc.pid)  # on the deadline, and any process the command left behind
            proc.wait()
        if returncode == 0:
            ran.finished.append(command.label)
        else:
            ran.failures.append(f"{command.label or 'the command'}: exit status {returncode}")
    ran.seconds = time.monotonic() - began
    log.flush()
    return ran
