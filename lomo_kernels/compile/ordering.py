"""Where compiled autograd's graph runs each in-backward update: after the last read of its
weight and of every alias of it."""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..core import torch_internals

# Ops that read a tensor's sizes, not its data: an update may run before them.
_METADATA_READS = (
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
)


def storage_key(t: Any) -> int | None:
    """Identity of a plain tensor's storage; None where it cannot be read (subclasses)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def hooked_params(graph: torch.fx.Graph, call_hook: Any) -> set[torch.fx.Node]:
    return {
        node.args[1]
        for node in graph.find_nodes(op="call_function", target=call_hook)
        if node.kwargs.get("hook_type") == "post_acc_grad_hook"
    }


def input_index(node: Any) -> int | None:
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
    index = input_index(param)
    key = storages[index] if index is not None and index < len(storages) else None
    if key is None or None in storages:
        return None
    graph = param.graph
    found = {n for n in graph.nodes if (k := input_index(n)) is not None and storages[k] == key}
    call_accumulate_grad, call_hook = torch_internals.compiled_autograd_calls()
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
        elif torch_internals.is_op_overload(node.target):
            returns = torch_internals.op_schema(node.target).returns
            if any(r.alias_info is not None for r in returns):
                found.add(node)  # a view (or an in-place op's result) of the weight
        elif node.target is not operator.getitem or node.args[0] in found:
            found.add(node)  # unknown callable: assume its result may alias
    return found


def move_updates_after_last_read(
    graph: torch.fx.Graph,
    storages: list[int | None],
    hooked: set[torch.fx.Node],
    call_hook: Any,
) -> None:
    """Moves each hooked AccumulateGrad (and its hooks) up to just after the last read of
    the weight and its aliases, so its gradient is freed as early as eager LOMO frees it.

    Only ever earlier than the eager position the nodes start from, and only when every
    alias is known; otherwise the eager position stays.
    """
    call_accumulate_grad = torch_internals.compiled_autograd_calls().accumulate_grad
    order = {node: i for i, node in enumerate(graph.nodes)}
    for acc in list(graph.find_nodes(op="call_function", target=call_accumulate_grad)):
        param = acc.args[0]
        if param not in hooked:
            continue
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
