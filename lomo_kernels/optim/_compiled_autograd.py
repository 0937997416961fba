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

`install` wraps three of compiled autograd's capture steps:
- `begin_capture` notes which graph inputs share storage (a weight and its saved copy);
- `reorder_accumulate_grad_nodes` leaves the AccumulateGrad nodes that carry
  post-accumulate-grad hooks where eager autograd runs them (after the producing node);
- after `reorder_post_acc_grad_hook_nodes`, each such node and its hooks move up to just
  after the last read of the weight or of anything that may alias it (inputs on the same
  storage, the AOT backward's saved copy, views; an unknown callable's result counts as an
  alias), so the gradient is freed as early as eager LOMO frees it. When an input's storage
  cannot be read (tensor subclasses) the eager position stays.
Inductor may still move a read of the weight below the update in its functional graph
(post-grad `reorder_for_locality`); it then clones the weight for the update and copies it
back at the end of the graph: correct, at the cost of memory. `check_supported` and the
refusal of an eager forward stop the set-ups that cannot be made correct, before any
parameter is written.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

_HIDDEN = object()  # stand-in target that hides a node from the reordering pass
# Ops that read a tensor's sizes, not its data: an update may run before them.
_METADATA_READS = (
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
)

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
        _installed = _patch_passes()
    return _installed


def _patch_passes() -> bool:
    try:
        from torch._dynamo.external_utils import call_accumulate_grad, call_hook
    except ImportError:
        return False
    owner = _pass_owner()
    names = ("begin_capture", "reorder_accumulate_grad_nodes", "reorder_post_acc_grad_hook_nodes")
    if owner is None or not all(callable(getattr(owner, n, None)) for n in names):
        return False
    begin_capture = owner.begin_capture
    reorder_accumulate = owner.reorder_accumulate_grad_nodes
    reorder_hooks = owner.reorder_post_acc_grad_hook_nodes

    @functools.wraps(begin_capture)
    def begin_capture_noting_storages(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self._lomo_input_storages = [_storage_key(t) for t in inputs]
        return begin_capture(self, inputs, *args, **kwargs)

    @functools.wraps(reorder_accumulate)
    def reorder_accumulate_grad_nodes(self: Any) -> None:
        held = [
            node
            for node in self.fx_tracer.graph.find_nodes(
                op="call_function", target=call_accumulate_grad
            )
            if node.args[0] in _hooked_params(self.fx_tracer.graph, call_hook)
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
        storages = getattr(self, "_lomo_input_storages", None)
        if storages is not None:
            _move_updates_after_last_read(self.fx_tracer.graph, storages, call_hook)

    owner.begin_capture = begin_capture_noting_storages
    owner.reorder_accumulate_grad_nodes = reorder_accumulate_grad_nodes
    owner.reorder_post_acc_grad_hook_nodes = reorder_post_acc_grad_hook_nodes
    return True


def _storage_key(t: Any) -> int | None:
    """Identity of a plain tensor's storage; None where it cannot be read (subclasses)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _hooked_params(graph: torch.fx.Graph, call_hook: Any) -> set[torch.fx.Node]:
    return {
        node.args[1]
        for node in graph.find_nodes(op="call_function", target=call_hook)
        if node.kwargs.get("hook_type") == "post_acc_grad_hook"
    }


def _input_index(node: Any) -> int | None:
    """k for a node `inputs[k]` of the compiled-autograd graph, else None."""
    if (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op == "placeholder"
        and node.args[0].target == "inputs"
    ):
        return node.args[1]
    return None


def _aliases(param: torch.fx.Node, storages: list[int | None]) -> set[torch.fx.Node] | None:
    """Every node whose value may share memory with `param`; None if that is unknowable.

    Sources: the graph inputs on the same storage (a saved copy or view of the weight), the
    outputs of an AOT backward prologue that pass one of those through (prologue output
    ``len(symints) + i`` is saved tensor ``i``), and whatever a view op or an unknown
    callable makes of an alias.
    """
    index = _input_index(param)
    key = storages[index] if index is not None and index < len(storages) else None
    if key is None or None in storages:
        return None
    graph = param.graph
    found = {n for n in graph.nodes if (k := _input_index(n)) is not None and storages[k] == key}
    from torch._dynamo.external_utils import call_accumulate_grad, call_hook

    for node in graph.nodes:
        if node in found or node.op != "call_function":
            continue
        if node.target in (call_accumulate_grad, call_hook):
            continue  # they write the weight; what they return is a placeholder, not a read
        readers = [a for a in node.all_input_nodes if a in found]
        if not readers:
            continue
        if getattr(node.target, "__name__", "") == "call_aot_bwd_prologue":
            saved, symints = node.args[0], node.args[1]
            positions = {len(symints) + i for i, t in enumerate(saved) if t in found}
            found.update(
                u for u in node.users if u.target is operator.getitem and u.args[1] in positions
            )
        elif isinstance(node.target, torch._ops.OpOverload):
            returns = node.target._schema.returns
            if any(r.alias_info is not None for r in returns):
                found.add(node)  # a view (or an in-place op's result) of the weight
        elif node.target is not operator.getitem or node.args[0] in found:
            found.add(node)  # unknown callable: assume its result may alias
    return found


def _move_updates_after_last_read(
    graph: torch.fx.Graph, storages: list[int | None], call_hook: Any
) -> None:
    """Moves each hooked AccumulateGrad (and its hooks) up to just after the last read of
    the weight and its aliases, so its gradient is freed as early as eager LOMO frees it.

    Only ever earlier than the eager position the nodes start from, and only when every
    alias is known; otherwise the eager position stays.
    """
    from torch._dynamo.external_utils import call_accumulate_grad

    order = {node: i for i, node in enumerate(graph.nodes)}
    for acc in list(graph.find_nodes(op="call_function", target=call_accumulate_grad)):
        param = acc.args[0]
        hooks = [
            n
            for n in param.users
            if n.target is call_hook and n.kwargs.get("hook_type") == "post_acc_grad_hook"
        ]
        if not hooks:
            continue
        aliases = _aliases(param, storages)
        if aliases is None:
            continue
        own = {acc, *hooks}
        # The gradient (and any existing .grad) must exist; the hook objects (`hooks[i]`)
        # depend on nothing and move along.
        needed = [a for a in acc.all_input_nodes if a is not param]
        readers = [
            u for a in aliases for u in a.users if u not in own and u.target not in _METADATA_READS
        ]
        readers += needed
        last = max(readers, key=order.__getitem__)
        if order[last] >= order[acc]:
            continue
        anchor = last
        for node in sorted([acc, *(h.args[0] for h in hooks), *hooks], key=order.__getitem__):
            if order[node] > order[anchor]:
                anchor.append(node)
                anchor = node
        order = {node: i for i, node in enumerate(graph.nodes)}


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
