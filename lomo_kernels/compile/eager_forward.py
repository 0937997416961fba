"""The refusal of an eager forward with compiled autograd (AOTAutograd cannot compile it)."""

from __future__ import annotations

from ..core import torch_internals
from . import scope

EAGER_FORWARD_MESSAGE = (
    "lomo_kernels: compiled autograd could not compile this backward (nothing was "
    "updated). With an eager (uncompiled) forward, autograd saves views of the weights (W.t() "
    "for a linear layer) next to the weights themselves; AOTAutograd cannot compile an "
    "in-place update of a tensor whose views are also graph inputs on torch {version}. "
    "Compile the forward as well (torch.compile(model)), or run the backward without "
    "compiled autograd."
)


def is_aliased_input_failure(error: BaseException) -> bool:
    """AOTAutograd's refusal of an in-place update of an input whose views are inputs too:
    a compiler backend failed on a capture whose inputs hold, next to one of our parameters,
    a non-leaf view of it (what an eager forward saves)."""
    return torch_internals.is_backend_compiler_failure(error) and scope.captured_views_of_ours()
