"""No tensor outlives a compiled-autograd capture because of how the backward graph is loaded.

AOTAutograd keeps a compiled forward's backward graph serialized; compiled autograd rebuilds
it by symbolic tracing, which runs a factory call with constant arguments eagerly and stores
the result in the module being traced, whose attribute dict is the serialized state itself.
For a bf16 embedding that tensor is fp32 of the embedding's shape (125 MiB at 32000 x 1024).
"""

from __future__ import annotations

import torch
from torch._dynamo import compiled_autograd
from torch._functorch._aot_autograd.aot_autograd_result import SerializedGraphModule
from torch._functorch._aot_autograd.runtime_wrappers import (
    CachedAutogradLazyBackwardCompileInfo,
)

from lomo_kernels.compile import embedding_backward, install, scope

SHAPE = [64, 32]


def _backward_like_graph() -> torch.fx.GraphModule:
    """grad -> accumulate into full(SHAPE, 0) at rows 0..n-1, as the embedding backward does."""
    graph = torch.fx.Graph()
    grad = graph.placeholder("grad")
    zeros = graph.call_function(
        torch.ops.aten.full.default, (SHAPE, 0), {"dtype": torch.float32, "device": "cpu"}
    )
    rows = graph.call_function(torch.ops.aten.arange.default, (4,))
    out = graph.call_function(torch.ops.aten.index_put.default, (zeros, [rows], grad, True))
    graph.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _tensors_in(state: dict) -> list[str]:
    return [k for k, v in state.items() if isinstance(v, torch.Tensor)]


class _CompiledFunction:
    def __init__(self, serialized: SerializedGraphModule) -> None:
        self._lazy_backward_info = CachedAutogradLazyBackwardCompileInfo(serialized.deserialize)


def test_torch_loader_keeps_the_constant_in_the_serialized_state():
    # The mechanism the patch works around: torch's own loader, unpatched.
    serialized = SerializedGraphModule(_backward_like_graph())
    module = serialized.deserialize()
    grad = torch.ones(4, SHAPE[1])
    assert torch.equal(module(grad)[0][:4], grad)
    assert any(
        isinstance(v, torch.Tensor) and list(v.shape) == SHAPE for v in serialized.args[0].values()
    ), "torch's loader no longer writes constants into the serialized state"


def test_compiled_autograd_loads_the_backward_from_a_copy(monkeypatch):
    assert install()
    monkeypatch.setattr(scope, "_capturing_ours", True)  # as in our capture
    serialized = SerializedGraphModule(_backward_like_graph())
    before = _tensors_in(serialized.args[0])
    module = compiled_autograd.extract_bw_module(_CompiledFunction(serialized))
    grad = torch.full((4, SHAPE[1]), 2.0)
    expected = torch.zeros(SHAPE).index_put_([torch.arange(4)], grad, accumulate=True)
    assert torch.equal(module(grad)[0], expected)
    assert _tensors_in(serialized.args[0]) == before
    # The rebuilt module holds the constant; it dies with the module.
    constants = [getattr(module, n.target) for n in module.graph.find_nodes(op="get_attr")]
    assert SHAPE in [list(c.shape) for c in constants]


def _graph_reading_a_constant(keep_it: bool) -> tuple[torch.nn.Module, torch.fx.Graph, tuple]:
    """x -> mul(add(constant, x), 2), the result unused; `keep_it` also outputs the constant."""
    root = torch.nn.Module()
    root._tensor_constant0 = torch.zeros(SHAPE)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    const = graph.get_attr("_tensor_constant0")
    put = graph.call_function(torch.ops.aten.add.Tensor, (const, x))
    narrow = graph.call_function(torch.ops.aten.mul.Tensor, (put, 2))
    graph.output((x, const) if keep_it else (x,))
    return root, graph, (narrow, put, const)


def test_dropping_an_unused_constant_frees_it_from_the_root():
    root, graph, nodes = _graph_reading_a_constant(keep_it=False)
    embedding_backward._drop_unused(graph, root, nodes)
    assert not hasattr(root, "_tensor_constant0")
    assert [n.op for n in graph.nodes] == ["placeholder", "output"]


def test_a_constant_still_read_is_kept():
    root, graph, nodes = _graph_reading_a_constant(keep_it=True)
    embedding_backward._drop_unused(graph, root, nodes)
    assert hasattr(root, "_tensor_constant0")
    assert nodes[2] in graph.nodes
    assert nodes[1] not in graph.nodes
