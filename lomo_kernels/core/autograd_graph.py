"""A walk of a loss's autograd graph before its backward runs: what the optimizers'
refusals read (`optim.loss_graph`) and how the
donated-buffer check finds compiled nodes (`torch_internals`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


def graph_nodes(root: Any, expands: Callable[[Any], bool] = lambda node: True) -> Iterator[Any]:
    """The nodes of the autograd graph from `root` (a ``grad_fn``, or None), each once, depth
    first; the inputs of a node are walked only where ``expands(node)`` (asked after the
    caller has read the node)."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if expands(node):
            stack.extend(next_node for next_node, _ in node.next_functions)


def leaf_inputs(node: Any) -> Iterator[Any]:
    """The leaf tensors `node` feeds a gradient to (their AccumulateGrad's variable)."""
    for next_node, _ in node.next_functions:
        variable = getattr(next_node, "variable", None)
        if variable is not None:
            yield variable
