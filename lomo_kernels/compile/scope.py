"""`install`: compiled autograd's capture steps adjusted for backwards holding our hooks.

Nothing is patched until compiled autograd first runs a backward of ours: `check_supported`
calls `install` before such a backward starts. Each patched step checks whether the backward
being captured has a parameter that one of this package's optimizers updates in its hooks
("ours", by their record of them: `core/ownership.py`); any other backward, and any other
hook in ours, runs torch's own code unchanged (the package docstring lists the steps).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..core import torch_internals
from ..core.ownership import updated_in_backward
from . import realize_reads
from .aot_cache import patch_backward_loading
from .embedding_backward import use_eager_embedding_backward
from .inductor_pass import DELAY_UPDATES
from .ordering import hooked_params, input_index, move_updates_after_last_read, storage_key

_HIDDEN = object()  # stand-in target that hides a node from the reordering pass

_installed: bool | None = None  # None: not tried yet
_missing: str = ""  # the name this torch lacks, when the capture could not be adjusted
# Whether the capture under way is of a backward that holds our hooks (read by the loader
# of cached backward graphs, which is not given the capturing instance).
_capturing_ours = False
# Whether that capture's inputs hold a view of one of our parameters that autograd saved
# from an eager forward (a non-leaf on the parameter's storage): AOTAutograd cannot compile
# an in-place update of a leaf whose non-leaf views are inputs too.
_ours_viewed_by_non_leaves = False


def install() -> bool:
    """Adjusts compiled autograd's capture of backwards holding parameters that our hooks
    update, once; False if this torch lacks what that needs (`missing` says what)."""
    global _installed
    if _installed is None:
        _installed = _patch_passes()
    return _installed


def installed() -> bool:
    """Whether `install` has adjusted compiled autograd's capture."""
    return bool(_installed)


def missing() -> str:
    """The name this torch lacks for `install`, after it failed ("" otherwise)."""
    return _missing


def capturing_ours() -> bool:
    """Whether the capture under way is of a backward holding our hooks."""
    return _capturing_ours


def captured_views_of_ours() -> bool:
    """Whether the capture under way (or the last one) holds, next to one of our
    parameters, a non-leaf view of it (what an eager forward saves, as W.t() for a linear)."""
    return _ours_viewed_by_non_leaves


def _our_inputs(inputs: list[Any]) -> set[int]:
    """Indices of the capture's inputs that are parameters our hooks update."""
    return {i for i, t in enumerate(inputs) if updated_in_backward(t)}


def _non_leaf_views(inputs: list[Any], ours: set[int], storages: list[int | None]) -> bool:
    """Whether an input other than ours is a non-leaf on the storage of one of ours."""
    our_storages = {storages[i] for i in ours} - {None}
    return any(
        i not in ours
        and isinstance(t, torch.Tensor)
        and not t.is_leaf
        and storages[i] in our_storages
        for i, t in enumerate(inputs)
    )


def _our_hooked_params(instance: Any, call_hook: Any) -> set[torch.fx.Node]:
    """The graph's parameters that carry a post-accumulate-grad hook and are ours."""
    ours = getattr(instance, "_lomo_ours", set())
    return {p for p in hooked_params(instance.fx_tracer.graph, call_hook) if input_index(p) in ours}


def _patch_passes() -> bool:
    global _missing
    lacking = torch_internals.capture_internals_missing()
    if lacking is not None:
        _missing = lacking.name
        return False
    owner = torch_internals.compiled_autograd_capture_class()
    call_accumulate_grad, call_hook = torch_internals.compiled_autograd_calls()
    names = (
        "begin_capture",
        "reorder_accumulate_grad_nodes",
        "reorder_post_acc_grad_hook_nodes",
        "end_capture",
    )
    absent = [n for n in names if not callable(getattr(owner, n, None))]
    if absent:
        _missing = f"{owner.__module__}.{owner.__qualname__}.{absent[0]}"
        return False
    begin_capture = owner.begin_capture
    reorder_accumulate = owner.reorder_accumulate_grad_nodes
    reorder_hooks = owner.reorder_post_acc_grad_hook_nodes
    end_capture = owner.end_capture

    # Each step below is kept out of Dynamo, as torch's own capture steps are (Dynamo skips
    # torch's files): in a step compiled whole, Dynamo would otherwise trace them as user
    # code, a graph of their own and guards on the capture's inputs.
    @functools.wraps(begin_capture)
    @torch.compiler.disable
    def begin_capture_noting_storages(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        global _capturing_ours, _ours_viewed_by_non_leaves
        self._lomo_ours = _our_inputs(inputs)
        _capturing_ours = bool(self._lomo_ours)
        _ours_viewed_by_non_leaves = False
        if _capturing_ours:
            self._lomo_input_storages = [storage_key(t) for t in inputs]
            _ours_viewed_by_non_leaves = _non_leaf_views(
                inputs, self._lomo_ours, self._lomo_input_storages
            )
        return begin_capture(self, inputs, *args, **kwargs)

    @functools.wraps(reorder_accumulate)
    @torch.compiler.disable
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
    @torch.compiler.disable
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
    @torch.compiler.disable
    def end_capture_with_inductor_pass(self: Any, outputs: Any) -> tuple[Any, Any]:
        runtime_wrapper, compiled = end_capture(self, outputs)
        if not getattr(self, "_lomo_updates_in_graph", False):
            return runtime_wrapper, compiled

        # Inductor compiles the graph on its first call (and again on a recompile), so
        # every call runs with the pass; the patch is only read while compiling.
        @functools.wraps(compiled)
        @torch.compiler.disable
        def compiled_with_pass(*args: Any, **kwargs: Any) -> Any:
            inductor_config = torch_internals.inductor_config()
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
