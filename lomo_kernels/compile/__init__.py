"""torch.compile integration: in-backward updates under compiled autograd and Inductor."""

from .scope import (
    EAGER_FORWARD_MESSAGE,
    TESTED_TORCH_VERSIONS,
    check_supported,
    compiled_autograd_active,
    install,
    is_aliased_input_failure,
    torch_version_tested,
)

__all__ = [
    "EAGER_FORWARD_MESSAGE",
    "TESTED_TORCH_VERSIONS",
    "check_supported",
    "compiled_autograd_active",
    "install",
    "is_aliased_input_failure",
    "torch_version_tested",
]
