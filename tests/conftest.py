"""Test set-up: Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before triton is first imported (it is read when kernels are
decorated), so it is set here, before any test module imports the package.
"""

import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread per xdist worker (`make test` runs two on the 2-core machines), else two.
torch.set_num_threads(
    1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads())
)


def available_backends() -> list[str]:
    """Backends that serve CPU tensors here; a backend that cannot load fails the suite."""
    from lomo_kernels.ops import backends

    names = []
    for name in backends.BACKEND_NAMES:
        module, reason = backends.LOMO.load(name, "cpu")
        if module is None:
            raise RuntimeError(f"backend {name} unavailable on CPU in tests: {reason}")
        names.append(name)
    return names


# The device of tests that can run on either (`make test-gpu` sets LOMO_TEST_DEVICE=cuda).
TEST_DEVICE = os.environ.get("LOMO_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def test_device() -> str:
    """LOMO_TEST_DEVICE (default cpu); a test asking for CUDA where there is none is skipped."""
    if TEST_DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"LOMO_TEST_DEVICE={TEST_DEVICE} but no CUDA device here")
    return TEST_DEVICE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that takes `test_device` can use a GPU: `make test-gpu` (-m cuda) selects it.
    for item in items:
        if "test_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cuda)
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    tests = Path(__file__).parent
    items.sort(key=lambda item: rank.get(item.path.relative_to(tests).as_posix(), len(rank)))


@pytest.fixture(params=["torch", "cpp", "triton"])
def backend(request) -> str:
    from lomo_kernels.ops import backends

    module, reason = backends.LOMO.load(request.param, "cpu")
    if module is None:
        pytest.fail(f"backend {request.param} must be available in CI: {reason}")
    return request.param


# -- which machine ran the suite, and how long it took (a slow CPU must show in the log) --------
SUITE_BUDGET_S = 20 * 60  # README: `make test` within 20 minutes on the 2-core machines
_suite_start = time.monotonic()


def machine_line() -> str:
    from lomo_kernels.tools import env as machine

    bf16 = "native" if machine.native_bf16_matmul() else "emulated: bf16-heavy tests use fp32"
    return (
        f"CPU {machine.cpu_model()} ({machine.vector_isa()}), {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} threads; bf16 matmul {bf16}"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return "machine: " + machine_line()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    elapsed = time.monotonic() - _suite_start
    over = "  OVER the 20-minute budget" if elapsed > SUITE_BUDGET_S else ""
    terminalreporter.write_line(f"suite time {elapsed / 60:.1f} min on {machine_line()}{over}")


# The files that take longest (minutes each, compilation and 2-rank runs), by path under tests/:
# collected first, so that `make test`'s two workers start on them (the Makefile keeps
# collection order).
SLOWEST_FIRST = (
    "compile/test_compile_llama.py",
    "compile/test_compile_shapes.py",
    "benchmarks/test_memory.py",
    "distributed/test_zero3.py",
    "distributed/test_fsdp2.py",
    "distributed/test_sharded_accumulation.py",
    "benchmarks/test_gpu_check.py",
)
