"""`install`: compiled autograd's capture steps adjusted for backwards holding our hooks.

Each patched step checks whether the backward being captured has a parameter that one of
this package's optimizers updates in its hooks ("ours"); any other backward, and any other
hook in ours, runs torch's own code unchanged (the package docstring lists the steps).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import realize_reads
from .aot_cache import patch_backward_loading
from .embedding_backward import use_eager_embedding_backward
from .inductor_pass import DELAY_UPDATES
from .ordering import hooked_params, input_index, move_updates_after_last_read, storage_key

_HIDDEN = object()  # stand-in target that hides a node from the reordering pass


def _pass_owner() -> Any:
    from torch._dynamo import compiled_autograd

    return getattr(compiled_autograd, "AutogradCompilerInstance", None)


_installed: bool | None = None  # None: not tried yet
# Whether the capture under way is of a backward that holds our hooks (read by the loader
# of cached backward graphs, which is not given the capturing instance).
_capturing_ours = False


def install(owned: Callable[[Any], bool]) -> bool:
    """Adjusts compiled autograd's capture of backwards holding parameters for which `owned`
    is true (those our hooks update), once; False if it cannot."""
    global _installed
    if _installed is None:
        _installed = _patch_passes(owned)
    return _installed


def installed() -> bool:
    """Whether `install` has adjusted compiled autograd's capture."""
    return bool(_installed)


def capturing_ours() -> bool:
    """Whether the capture under way is of a backward holding our hooks."""
    return _capturing_ours


def _our_inputs(inputs: list[Any], owned: Callable[[Any], bool]) -> set[int]:
    """Indices of the capture's inputs that are parameters our hooks update."""
    return {i for i, t in enumerate(inputs) if owned(t)}


def _our_hooked_params(instance: Any, call_hook: Any) -> set[torch.fx.Node]:
    """The graph's parameters that carry a post-accumulate-grad hook and are ours."""
    ours = getattr(instance, "_lomo_ours", set())
    return {p for p in hooked_params(instance.fx_tracer.graph, call_hook) if input_index(p) in ours}


def _patch_passes(owned: Callable[[Any], bool]) -> bool:
    try:
        from torch._dynamo.external_utils import call_accumulate_grad, call_hook
    except ImportError:
        return False
    owner = _pass_owner()
    names = (
        "begin_capture",
        "reorder_accumulate_grad_nodes",
        "reorder_post_acc_grad_hook_nodes",
        "end_capture",
    )
    if owner is None or not all(callable(getattr(owner, n, None)) for n in names):
        return False
    begin_capture = owner.begin_capture
    reorder_accumulate = owner.reorder_accumulate_grad_nodes
    reorder_hooks = owner.reorder_post_acc_grad_hook_nodes
    end_capture = owner.end_capture

    @functools.wraps(begin_capture)
    def begin_capture_noting_storages(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        global _capturing_ours
        self._lomo_ours = _our_inputs(inputs, owned)
        _capturing_ours = bool(self._lomo_ours)
        if _capturing_ours:
            self._lomo_input_storages = [storage_key(t) for t in inputs]
        return begin_capture(self, inputs, *args, **kwargs)

    @functools.wraps(reorder_accumulate)
    def reorder_accumulate_grad_nodes(self: Any) -> None:
        ours = _our_hooked_params(self, call_hook)
        held = [
            node
            for node in self.fx_tracer.graph.find_nodes(
                op="call_function", target=call_accumulate_grad
            )
            if node.args[0] in ours
        ]
        # Hide these nodes from torch's pass by their target, so it moves only the others.
        for node in held:
            node.target = _HIDDEN
        try:
            reorder_accumulate(self)
        finally:
            for node in held:
                node.target = call_accumulate_grad

    @functools.wraps(reorder_hooks)
    def reorder_post_acc_grad_hook_nodes(self: Any) -> None:
        reorder_hooks(self)
        hooked = _our_hooked_params(self, call_hook)
        self._lomo_updates_in_graph = bool(hooked)
        if not hooked:
            return
        graph = self.fx_tracer.graph
        use_eager_embedding_backward(graph, hooked, self.fx_tracer.root)
        storages = getattr(self, "_lomo_input_storages", None)
        if storages is not None:
            move_updates_after_last_read(graph, storages, hooked, call_hook)

    @functools.wraps(end_capture)
    def end_capture_with_inductor_pass(self: Any, outputs: Any) -> tuple[Any, Any]:
        runtime_wrapper, compiled = end_capture(self, outputs)
        if not getattr(self, "_lomo_updates_in_graph", False):
            return runtime_wrapper, compiled

        # Inductor compiles the graph on its first call (and again on a recompile), so
        # every call runs with the pass; the patch is only read while compiling.
        @functools.wraps(compiled)
        def compiled_with_pass(*args: Any, **kwargs: Any) -> Any:
            from torch._inductor import config as inductor_config

            user_passes = inductor_config.post_grad_custom_post_pass
            if user_passes is None:
                passes: Any = DELAY_UPDATES.get()
            elif isinstance(user_passes, list | tuple):
                passes = [*user_passes, DELAY_UPDATES.get()]
            else:
                passes = [user_passes, DELAY_UPDATES.get()]
            # reorder_for_locality would move reads of each weight next to their consumers,
            # after the update compiled autograd placed behind them, undoing that placement.
            with (
                inductor_config.patch(
                    post_grad_custom_post_pass=passes, reorder_for_locality=False
                ),
                realize_reads.realizing_reads_before_writes(),
            ):
                return compiled(*args, **kwargs)

        return runtime_wrapper, compiled_with_pass

    owner.begin_capture = begin_capture_noting_storages
    patch_backward_loading(capturing_ours)
    owner.reorder_accumulate_grad_nodes = reorder_accumulate_grad_nodes
    owner.reorder_post_acc_grad_hook_nodes = reorder_post_acc_grad_hook_nodes
    owner.end_capture = end_capture_with_inductor_pass
    return True
