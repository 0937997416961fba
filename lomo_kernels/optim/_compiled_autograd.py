"""Parameters updated inside a backward that compiled autograd traces.

Compiled autograd (``torch._dynamo.compiled_autograd``) traces the whole backward, hooks
included, into one graph in the order eager autograd runs the nodes, then
``reorder_accumulate_grad_nodes`` moves every AccumulateGrad, and the post-accumulate-grad
hooks after it, to right after the op that produces the gradient. That is earlier than eager
autograd, which runs them only once the producing node has finished. When the forward was
compiled the whole backward is one node (the AOT backward graph, pasted into the traced
graph), and it still reads a weight after producing that weight's gradient: ``mm(dy, W)``
for the input gradient comes after ``mm(dy.T, x)``. A hook that updates ``W`` in place
there feeds the updated ``W`` into the input gradients of every layer below: each update
is off by 1-40% after one step, with no error (eager autograd would have raised, as a saved
tensor was modified in place).

`install` keeps the AccumulateGrad nodes that carry post-accumulate-grad hooks where eager
autograd runs them, so every read of the parameter within its producing node comes first;
the other AccumulateGrad nodes are still moved. Inductor still sees the true dependency
(the parameter and its saved copy are one graph input) and its memory-aware scheduling may
move an update earlier, never before a read. `check_supported` refuses the set-ups that
cannot be made correct, before any parameter is written.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_HIDDEN = object()  # stand-in target that hides a node from the reordering pass

UNSUPPORTED_MESSAGE = (
    "lomo_kernels: compiled autograd is enabled, but this torch ({version}) lacks the "
    "compiled-autograd pass that lomo_kernels adjusts to keep in-backward updates after "
    "every read of the parameter; such updates would be silently wrong. Run the backward "
    "without compiled autograd (torch.compile of the forward alone is supported)."
)

EAGER_FORWARD_MESSAGE = (
    "lomo_kernels: compiled autograd could not compile this backward (nothing was "
    "updated). With an eager (uncompiled) forward, autograd saves views of the weights (W.t() "
    "for a linear layer) next to the weights themselves; AOTAutograd cannot compile an "
    "in-place update of a tensor whose views are also graph inputs on torch {version}. "
    "Compile the forward as well (torch.compile(model)), or run the backward without "
    "compiled autograd."
)


def _pass_owner() -> Any:
    from torch._dynamo import compiled_autograd

    return getattr(compiled_autograd, "AutogradCompilerInstance", None)


_installed: bool | None = None  # None: not tried yet


def install() -> bool:
    """Adjusts compiled autograd's AccumulateGrad reordering once; False if it cannot."""
    global _installed
    if _installed is None:
        _installed = _patch_reordering()
    return _installed


def _patch_reordering() -> bool:
    try:
        from torch._dynamo.external_utils import call_accumulate_grad, call_hook
    except ImportError:
        return False
    owner = _pass_owner()
    original = getattr(owner, "reorder_accumulate_grad_nodes", None)
    if original is None:
        return False

    @functools.wraps(original)
    def reorder_accumulate_grad_nodes(self: Any) -> None:
        graph = self.fx_tracer.graph
        hooked_params = {
            node.args[1]
            for node in graph.find_nodes(op="call_function", target=call_hook)
            if node.kwargs.get("hook_type") == "post_acc_grad_hook"
        }
        held = [
            node
            for node in graph.find_nodes(op="call_function", target=call_accumulate_grad)
            if node.args[0] in hooked_params
        ]
        # Hide these nodes from torch's pass by their target, so it moves only the others.
        for node in held:
            node.target = _HIDDEN
        try:
            original(self)
        finally:
            for node in held:
                node.target = call_accumulate_grad

    owner.reorder_accumulate_grad_nodes = reorder_accumulate_grad_nodes
    return True


def compiled_autograd_active() -> bool:
    """Whether a backward started now would be traced by compiled autograd."""
    from torch._dynamo import compiled_autograd

    return bool(
        getattr(compiled_autograd, "compiled_autograd_enabled", False)
        or torch._dynamo.config.compiled_autograd
    )


def check_supported() -> None:
    """Raises before any update when compiled autograd is on and the fix is unavailable.

    Reads only module state, so a compiled training step can trace it without a break.
    """
    if compiled_autograd_active() and not _installed:
        raise RuntimeError(UNSUPPORTED_MESSAGE.format(version=torch.__version__))


def is_aliased_input_failure(error: BaseException) -> bool:
    """AOTAutograd's refusal of an in-place update of an input whose views are inputs too."""
    text = f"{error}\n{error.__cause__}"
    return "any_leaf" in text and "all_leaf" in text
