"""Test set-up: Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before triton is first imported (it is read when kernels are
decorated), so it is set here, before any test module imports the package.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


def available_backends() -> list[str]:
    """Backends that serve CPU tensors here; a backend that cannot load fails the suite."""
    from lomo_kernels.ops import backends

    names = []
    for name in backends.BACKEND_NAMES:
        module, reason = backends.SGD.load(name, "cpu")
        if module is None:
            raise RuntimeError(f"backend {name} unavailable on CPU in tests: {reason}")
        names.append(name)
    return names


@pytest.fixture(params=["torch", "cpp", "triton"])
def backend(request) -> str:
    from lomo_kernels.ops import backends

    module, reason = backends.SGD.load(request.param, "cpu")
    if module is None:
        pytest.fail(f"backend {request.param} must be available in CI: {reason}")
    return request.param
