"""Compiled autograd's loading of a cached AOT backward graph, from a copy of its state."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.fx.graph_module import reduce_graph_module

from ..core import torch_internals


def patch_backward_loading(capturing_ours: Callable[[], bool]) -> None:
    """Makes compiled autograd rebuild a cached AOT backward graph from a copy of its state
    while it captures a backward holding our hooks (`capturing_ours()`).

    A compiled forward loaded from AOTAutograd's cache keeps its backward graph serialized;
    compiled autograd rebuilds it at capture by symbolic tracing, which runs a factory call
    with constant arguments eagerly and stores the result as an attribute of the module
    being traced. That module's attribute dict is the cached state itself, so the tensor
    stays alive as long as the compiled forward: for the embedding backward's ``full(shape,
    0)`` an fp32 tensor of the embedding's shape (125 MiB for 32000 x 1024), on the
    weight's device. Rebuilt from a copy, the tensor lives only during the capture (the
    graph no longer reads it once `use_eager_embedding_backward` has run).
    """
    extract = torch_internals.backward_graph_extractor()
    if not callable(extract) or getattr(extract, "_lomo_copies_state", False):
        return

    @functools.wraps(extract)
    def extract_from_copy(compiled_function: Any) -> Any:
        if not capturing_ours():
            return extract(compiled_function)
        loader = torch_internals.serialized_backward_loader(compiled_function)
        serialized = getattr(loader, "__self__", None)
        args = getattr(serialized, "args", None)
        if getattr(serialized, "fn", None) is not reduce_graph_module or not (
            isinstance(args, tuple) and args and isinstance(args[0], dict)
        ):
            return extract(compiled_function)
        real_tensors = torch_internals.outside_fake_tensor_mode()
        if real_tensors is None:
            return extract(compiled_function)
        with real_tensors:  # as torch's own loader
            return reduce_graph_module(dict(args[0]), *args[1:])

    extract_from_copy._lomo_copies_state = True  # type: ignore[attr-defined]
    torch_internals.set_backward_graph_extractor(extract_from_copy)
