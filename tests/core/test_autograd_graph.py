"""The walk of an autograd graph (core/autograd_graph.py) on graphs built by hand, whose nodes
and leaves are known from how they were built."""

from __future__ import annotations

import torch
from support.graphs import diamonds

from lomo_kernels.core.autograd_graph import graph_nodes, leaf_inputs


def test_each_node_is_yielded_once_however_many_paths_reach_it():
    weight = torch.randn(3, requires_grad=True)
    nodes = list(graph_nodes(diamonds(weight, 16).grad_fn))
    # The sum, 3 nodes a level and the weight's AccumulateGrad, each once.
    assert len(nodes) == len({id(node) for node in nodes}) == 1 + 3 * 16 + 1
    assert list(graph_nodes(None)) == []


def test_inputs_are_walked_only_where_expands_says():
    weight = torch.randn(3, requires_grad=True)
    loss = diamonds(weight, 4)
    assert [node.name() for node in graph_nodes(loss.grad_fn, lambda node: False)] == [
        "SumBackward0"
    ]
    # Stop at the additions: the sum and the first level's addition only.
    stop_at_adds = list(graph_nodes(loss.grad_fn, lambda node: node.name() != "AddBackward0"))
    assert [node.name() for node in stop_at_adds] == ["SumBackward0", "AddBackward0"]


def test_leaf_inputs_are_the_leaves_a_node_feeds():
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    product = a * b * torch.randn(3)  # a * b, then a factor that needs no gradient
    inner = product.grad_fn.next_functions[0][0]
    assert [id(t) for t in leaf_inputs(inner)] == [id(a), id(b)]
    assert list(leaf_inputs(product.grad_fn)) == []  # an inner node and an empty slot
