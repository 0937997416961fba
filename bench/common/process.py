"""A measurement in a fresh interpreter: `run_isolated`, and the child's entry point.

A peak-memory figure needs a process of its own: the malloc setting must be in its
environment before it starts (`meter`), and nothing an earlier measurement left behind
(caches, compiled code, lazy state) may count in it. `run_isolated(function, kwargs)` starts
``python -m bench.common.process REQUEST``, which calls `function(**kwargs)` and
prints its JSON result on a marked line, the answer. With `ranks` > 1 the ranks start under
`torch.distributed.run` (one port of its own per run); the function returns the result on
one rank and None on the others.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .meter import MMAP_ENV, MMAP_VALUE

# Libraries print to stdout too (DeepSpeed, torchrun): the result is the line with this mark.
RESULT_MARK = "LOMO_KERNELS_RESULT "


class ProcessFailed(RuntimeError):
    """A measuring process that exited without a result; `killed`: by SIGKILL (on Linux the
    out-of-memory killer)."""

    def __init__(self, what: str, returncode: int, output: str) -> None:
        super().__init__(f"{what} failed (exit status {returncode}):\n{output[-4000:]}")
        self.returncode = returncode

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL


def child_env(metered: bool, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a measuring process: the malloc setting when `metered` (its peak
    memory is read; the setting slows every large allocation) and never otherwise, this
    repository (the package and bench/) first on the path, and `extra`."""
    env = dict(os.environ)
    env.pop(MMAP_ENV, None)
    if metered:
        env[MMAP_ENV] = MMAP_VALUE
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env | dict(extra or {})


def free_port() -> int:
    """A TCP port nothing listens on now, for a run's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_isolated(
    function: Callable[..., Any],
    kwargs: Mapping[str, Any],
    *,
    metered: bool = True,
    ranks: int = 1,
    env: Mapping[str, str] | None = None,
    stderr_through: bool = False,
    timeout: float | None = None,
    what: str | None = None,
) -> Any:
    """`function(**kwargs)` in a fresh interpreter (`ranks` of them under torchrun); its
    JSON result. Raises ProcessFailed, with the process's stderr, when it gives none.

    `function` is found again by its module and name in the child; `kwargs` travel as JSON.
    `metered`: with the malloc setting (`child_env`). `stderr_through`: the child's stderr
    (a progress bar) goes to this process's stderr instead of the error message.
    """
    request = json.dumps(
        {"function": f"{function.__module__}:{function.__qualname__}", "kwargs": dict(kwargs)}
    )
    child = ["-m", __name__, request]
    if ranks > 1:
        launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        child = [*launch, "--master_port", str(free_port()), *child]
    proc = subprocess.run(
        [sys.executable, *child],
        env=child_env(metered, env),
        stdout=subprocess.PIPE,
        stderr=None if stderr_through else subprocess.PIPE,
        text=True,
        timeout=timeout,
        check=False,
    )
    results = marked_results(proc.stdout)
    if ranks > 1:  # the one rank that answers
        results = [result for result in results if result is not None]
    if proc.returncode != 0 or len(results) != 1:
        output = (proc.stderr or "") or proc.stdout
        raise ProcessFailed(what or function.__name__, proc.returncode, output)
    return results[0]


def marked_results(stdout: str) -> list[Any]:
    """Every JSON value written after RESULT_MARK in `stdout`. Found by the mark, not by line:
    the ranks of a torchrun share one pipe, and another rank's output may land on the same
    line."""
    decoder, results, start = json.JSONDecoder(), [], stdout.find(RESULT_MARK)
    while start != -1:
        value, end = decoder.raw_decode(stdout, start + len(RESULT_MARK))
        results.append(value)
        start = stdout.find(RESULT_MARK, end)
    return results


def _child_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one measurement (started by run_isolated)")
    parser.add_argument("request", help="JSON written by run_isolated")
    request = json.loads(parser.parse_args(argv).request)
    module, _, name = request["function"].partition(":")
    result = getattr(importlib.import_module(module), name)(**request["kwargs"])
    # One write per result (a line at once, not text then newline), and none from the ranks
    # that have nothing to report, so that ranks sharing the pipe interleave as little as
    # they can.
    if result is not None or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        sys.stdout.write(f"{RESULT_MARK}{json.dumps(result)}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _child_main()
