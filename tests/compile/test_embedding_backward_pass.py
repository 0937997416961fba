"""The compiled-autograd pass that gives a hooked bf16/fp16 embedding ATen's backward instead
of the fp32 decomposition a compiled forward leaves (`use_eager_embedding_backward`).

The decomposition differs between torch releases: the installed torch's own form is taken
from its decomposition table; the form of torch <= 2.11 (masked_fill + `_unsafe_index_put`,
AccumulateGrad called with three arguments) is written out as that release emits it, since
a GPU run on torch 2.11 showed the fp32 buffer (2x the embedding's bf16 size) still
allocated when only the newer form was recognised. A backward loaded from AOTAutograd's cache
holds the decomposition's zero tensors as constants of the graph's root module instead of
``full`` calls (seen on the GPU when a compiled forward without compiled autograd had filled
the cache first); each form is also checked that way.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.external_utils import call_accumulate_grad
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import lomo_kernels  # noqa: F401  (registers lomo_kernels::embedding_dense_backward_eager)
from lomo_kernels.compile import embedding_backward

VOCAB, HIDDEN = 50, 8
aten, prims = torch.ops.aten, torch.ops.prims
EAGER = torch.ops.lomo_kernels.embedding_dense_backward_eager.default


def _older_decomposition(grad_output, indices, padding_idx, accumulate=True):
    """torch <= 2.11's embedding_dense_backward decomposition, op for op."""
    widened = prims.convert_element_type.default(grad_output, torch.float32)
    mask = aten.unsqueeze.default(aten.eq.Scalar(indices, padding_idx), -1)
    grad = aten.masked_fill.Scalar(widened, mask, 0)
    zeros = aten.full.default([VOCAB, HIDDEN], 0, dtype=torch.float32)
    put = aten._unsafe_index_put.default(zeros, [indices], grad, accumulate)
    return prims.convert_element_type.default(put, grad_output.dtype)


def _torch_2_11_graph(grad_output, indices, padding_idx):
    """The nodes torch 2.11's compiled-autograd graph holds on a GPU (read off its log): the
    masked_fill became a ``where`` with a shared ``full([], 0.0)`` zero."""
    widened = prims.convert_element_type.default(grad_output, torch.float32)
    mask = aten.unsqueeze.default(aten.eq.Scalar(indices, padding_idx), -1)
    zero = aten.full.default([], 0.0, dtype=torch.float32)
    grad = aten.where.self(mask, zero, widened)
    zeros = aten.full.default([VOCAB, HIDDEN], 0, dtype=torch.float32)
    put = aten.index_put.default(zeros, [indices], grad, True)
    return prims.convert_element_type.default(put, grad_output.dtype)


def _current_decomposition(grad_output, indices, padding_idx):
    decomp = select_decomp_table()[aten.embedding_dense_backward.default]
    return decomp(grad_output, indices, VOCAB, padding_idx, False)


def _graph_with_accumulate(fn, dtype, arity: int) -> tuple[torch.fx.Graph, torch.fx.Node]:
    """`fn`'s graph for (grad_output, indices), its result fed to an AccumulateGrad of a
    weight placeholder the way compiled autograd calls it (3 or 4 arguments)."""
    grad_output = torch.randn(3, 5, HIDDEN).to(dtype)
    indices = torch.randint(0, VOCAB, (3, 5))
    # Traced through Inductor's decomposition table, as AOTAutograd traces a compiled forward.
    graph = make_fx(fn, decomposition_table=select_decomp_table())(grad_output, indices).graph
    out = graph.find_nodes(op="output")[0]
    result = out.args[0]
    with graph.inserting_before(graph.find_nodes(op="placeholder")[0]):
        weight = graph.placeholder("weight")
    with graph.inserting_before(out):
        args = (weight, result, True) if arity == 3 else (weight, None, result, True)
        graph.call_function(call_accumulate_grad, args)
    out.args = (None,)
    return graph, weight


def _as_loaded_from_cache(graph: torch.fx.Graph) -> torch.nn.Module:
    """Replaces every ``full(shape, 0)`` of `graph` by a ``get_attr`` of a zero constant, as
    compiled autograd's rebuild of a cached backward leaves them; returns the root module."""
    root = torch.nn.Module()
    for i, node in enumerate(graph.find_nodes(op="call_function", target=aten.full.default)):
        name = f"_tensor_constant{i}"
        setattr(root, name, torch.zeros(node.args[0], dtype=node.kwargs["dtype"]))
        with graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the graph has no owning module
            constant = graph.get_attr(name)
        node.replace_all_uses_with(constant)
        graph.erase_node(node)
    return root


def _constants(root: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for k, v in vars(root).items() if isinstance(v, torch.Tensor)]


def _accumulated(graph: torch.fx.Graph) -> torch.fx.Node:
    acc = graph.find_nodes(op="call_function", target=call_accumulate_grad)[0]
    return embedding_backward._accumulated_grad(acc)


CASES = {
    "older-form": (_older_decomposition, 3),
    "torch-2.11-gpu-graph": (_torch_2_11_graph, 3),
    "installed-torch-form": (_current_decomposition, 4),
}


@pytest.mark.parametrize("cached", [False, True], ids=["traced", "loaded-from-cache"])
@pytest.mark.parametrize("padding_idx", [-1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_decomposition_is_replaced_by_aten_backward(case, dtype, padding_idx, cached):
    fn, arity = CASES[case]
    graph, weight = _graph_with_accumulate(lambda g, i: fn(g, i, padding_idx), dtype, arity)
    root = _as_loaded_from_cache(graph) if cached else None
    embedding_backward.use_eager_embedding_backward(graph, {weight}, root)
    grad = _accumulated(graph)
    grad_output, indices = graph.find_nodes(op="placeholder")[1:]
    assert grad.target is EAGER
    assert grad.args == (grad_output, indices, VOCAB, padding_idx)
    # The fp32 buffer of the weight's shape is erased, its constant too (the rest is left
    # to compiled autograd's dead-code pass).
    fulls = graph.find_nodes(op="call_function", target=aten.full.default)
    assert not [n for n in fulls if n.args[0] == [VOCAB, HIDDEN]]
    if cached:
        assert not [name for name, t in _constants(root) if t.shape == (VOCAB, HIDDEN)]


@pytest.mark.parametrize("case", CASES)
def test_tied_weight_gets_aten_backward_for_its_embedding_term(case):
    # A weight tied to the output projection accumulates the sum of both uses' gradients.
    fn, arity = CASES[case]

    def tied(grad_output, indices):
        ones = aten.full.default([VOCAB, 4], 1.0, dtype=grad_output.dtype)
        projection = aten.mm.default(ones, aten.full.default([4, HIDDEN], 1.0, dtype=ones.dtype))
        return aten.add.Tensor(projection, fn(grad_output, indices, 7))

    graph, weight = _graph_with_accumulate(tied, torch.bfloat16, arity)
    embedding_backward.use_eager_embedding_backward(graph, {weight})
    total = _accumulated(graph)
    grad_output, indices = graph.find_nodes(op="placeholder")[1:]
    assert total.target is aten.add.Tensor
    assert total.args[0].target is aten.mm.default
    assert total.args[1].target is EAGER
    assert total.args[1].args == (grad_output, indices, VOCAB, 7)


def test_cached_constant_that_is_not_zero_is_left_alone():
    # A constant where the zero should be is matched only if it is zero: a nonzero fill
    # value would change the gradient of the padding rows.
    graph, weight = _graph_with_accumulate(
        lambda g, i: _torch_2_11_graph(g, i, 7), torch.bfloat16, 3
    )
    root = _as_loaded_from_cache(graph)
    scalar = next(name for name, t in _constants(root) if t.dim() == 0)
    setattr(root, scalar, torch.tensor(1.0))
    embedding_backward.use_eager_embedding_backward(graph, {weight}, root)
    assert _accumulated(graph).target is prims.convert_element_type.default


@pytest.mark.parametrize("case", CASES)
def test_unhooked_weight_keeps_the_decomposition(case):
    fn, arity = CASES[case]
    graph, _ = _graph_with_accumulate(lambda g, i: fn(g, i, -1), torch.bfloat16, arity)
    embedding_backward.use_eager_embedding_backward(graph, set())
    assert _accumulated(graph).target is prims.convert_element_type.default
    assert graph.find_nodes(op="call_function", target=aten.full.default)


def test_older_form_without_accumulation_is_left_alone():
    # An index_put that overwrites is not an embedding backward: repeated rows would differ.
    graph, weight = _graph_with_accumulate(
        lambda g, i: _older_decomposition(g, i, -1, accumulate=False), torch.bfloat16, 3
    )
    embedding_backward.use_eager_embedding_backward(graph, {weight})
    assert _accumulated(graph).target is prims.convert_element_type.default


def test_fp32_weight_keeps_its_graph():
    # fp32 gradients need no fp32 copy: nothing to replace.
    graph, weight = _graph_with_accumulate(
        lambda g, i: _older_decomposition(g, i, -1), torch.float32, 3
    )
    embedding_backward.use_eager_embedding_backward(graph, {weight})
    assert _accumulated(graph).target is prims.convert_element_type.default
