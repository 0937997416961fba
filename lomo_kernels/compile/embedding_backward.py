"""A hooked bf16/fp16 embedding's gradient from ATen's backward, not the fp32 decomposition."""

from __future__ import annotations

from typing import Any

import torch

from ..core import torch_internals
from ..ops import embedding  # noqa: F401  (registers the op this pass inserts)


def _call_args(node: Any, target: Any, count: int) -> tuple[Any, ...] | None:
    """`node`'s first `count` positional arguments if it calls `target`, else None (always
    for a None target: an op this torch lacks)."""
    if (
        target is not None
        and isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target is target
        and len(node.args) >= count
    ):
        return tuple(node.args[:count])
    return None


def _padding_idx(mask: Any, indices: Any, num_weights: int) -> int | None:
    """padding_idx of the decomposition's mask, ``((i >= 0) & (i < V) & (i != pad))[..., None]``."""
    aten = torch.ops.aten
    unsqueezed = _call_args(mask, aten.unsqueeze.default, 2)
    if not unsqueezed or unsqueezed[1] != -1:
        return None
    outer = _call_args(unsqueezed[0], aten.bitwise_and.Tensor, 2)
    inner = outer and _call_args(outer[0], aten.bitwise_and.Tensor, 2)
    ne = outer and _call_args(outer[1], aten.ne.Scalar, 2)
    ge = inner and _call_args(inner[0], aten.ge.Scalar, 2)
    lt = inner and _call_args(inner[1], aten.lt.Scalar, 2)
    if not (ne and ge and lt) or ge != (indices, 0) or lt != (indices, num_weights):
        return None
    if ne[0] is not indices or not isinstance(ne[1], int):
        return None
    return ne[1]


def _zero_constant(node: Any, root: Any) -> torch.Tensor | None:
    """The tensor behind `node` if it is a ``get_attr`` of an all-zero constant of `root`.

    A backward graph loaded from AOTAutograd's cache holds the factory calls of the
    decomposition (``full(shape, 0)``, ``full([], 0.0)``) as such constants, made when
    compiled autograd rebuilds the graph (see `patch_backward_loading`)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr" and root is not None):
        return None
    value = getattr(root, str(node.target), None)
    if not isinstance(value, torch.Tensor) or value.device.type == "meta" or bool(value.any()):
        return None
    return value


def _fp32_zeros_shape(node: Any, root: Any) -> list[int] | None:
    """The static shape of `node` if it is an fp32 zero tensor: ``full(shape, 0)``, or the
    constant a backward loaded from the cache holds in its place (`_zero_constant`)."""
    zeros = _call_args(node, torch.ops.aten.full.default, 2)
    constant = _zero_constant(node, root)
    if zeros:
        shape = zeros[0]
        if zeros[1] != 0 or node.kwargs.get("dtype") != torch.float32:
            return None
    elif constant is not None and constant.dtype == torch.float32:
        shape = list(constant.shape)
    else:
        return None
    if isinstance(shape, list | tuple) and all(isinstance(d, int) for d in shape):
        return list(shape)
    return None


def _accumulated_grad(acc: torch.fx.Node) -> Any:
    """The new gradient an AccumulateGrad call receives: ``(variable, variable.grad, grad,
    has_post_hooks)`` on current torch, ``(variable, grad, has_post_hooks)`` before 2.12."""
    position = {4: 2, 3: 1}.get(len(acc.args))
    return None if position is None else acc.args[position]


def _decomposed_embedding_backward(narrowed: Any, root: Any) -> tuple[Any, ...] | None:
    """(grad_output, indices, num_weights, padding_idx, zeros) if `narrowed` (what is cast
    back to the weight's dtype) is the embedding-backward decomposition of a compiled forward.

    Both forms accumulate ``grad_output.float()`` into an fp32 zero tensor:
    torch >= 2.12: ``_unsafe_masked_index_put_accumulate(zeros, valid & (i != pad), [i], g)``;
    earlier:       ``_unsafe_index_put(zeros, [i], g.masked_fill((i == pad)[..., None], 0),
    accumulate=True)``, which Inductor's table turns into ``index_put`` of a ``where``.
    """
    masked_put = _call_args(narrowed, torch_internals.unsafe_masked_index_put_accumulate_op(), 4)
    if masked_put:
        zeros, mask, indices, widened = masked_put
    else:
        put = _call_args(narrowed, torch.ops.aten.index_put.default, 4) or _call_args(
            narrowed, torch_internals.unsafe_index_put_op(), 4
        )
        fill = put and put[3] is True and _masked_with_zero(put[2], root)
        if not fill:
            return None
        zeros, indices, (widened, mask) = put[0], put[1], fill
    widen = _call_args(widened, torch.ops.prims.convert_element_type.default, 2)
    if not widen or widen[1] != torch.float32 or len(indices) != 1:
        return None
    shape = _fp32_zeros_shape(zeros, root)
    if shape is None:
        return None
    index = indices[0]
    if masked_put:
        padding_idx = _padding_idx(mask, index, shape[0])
    else:
        padding_idx = _padding_idx_of_equality(mask, index)
    if padding_idx is None:
        return None
    return widen[0], index, shape[0], padding_idx, zeros


def _masked_with_zero(node: Any, root: Any) -> tuple[Any, Any] | None:
    """(values, mask) if `node` is ``values.masked_fill(mask, 0)``, as such or decomposed
    into ``where(mask, zero, values)`` with a 0-d zero (``scalar_tensor``, ``full([])`` or,
    in a backward loaded from the cache, a constant of `root`)."""
    aten = torch.ops.aten
    fill = _call_args(node, aten.masked_fill.Scalar, 3)
    if fill:
        return (fill[0], fill[1]) if fill[2] == 0 else None
    where = _call_args(node, aten.where.self, 3)
    if not where:
        return None
    scalar = _call_args(where[1], aten.scalar_tensor.default, 1)
    full = _call_args(where[1], aten.full.default, 2)
    constant = _zero_constant(where[1], root)
    if (
        not (scalar and scalar[0] == 0)
        and not (full and full[0] == [] and full[1] == 0)
        and not (constant is not None and constant.dim() == 0)
    ):
        return None
    return where[2], where[0]


def _padding_idx_of_equality(mask: Any, indices: Any) -> int | None:
    """padding_idx of the older decomposition's mask, ``(i == pad)[..., None]``."""
    unsqueezed = _call_args(mask, torch.ops.aten.unsqueeze.default, 2)
    eq = (
        unsqueezed
        and unsqueezed[1] == -1
        and _call_args(unsqueezed[0], torch.ops.aten.eq.Scalar, 2)
    )
    if not eq or eq[0] is not indices or not isinstance(eq[1], int):
        return None
    return eq[1]


def use_eager_embedding_backward(
    graph: torch.fx.Graph, hooked: set[torch.fx.Node], root: Any = None
) -> None:
    """Gives each hooked embedding weight ATen's embedding backward instead of the
    decomposition a compiled forward leaves in its backward graph.

    For a bf16/fp16 weight that decomposition converts the output gradient to fp32 and
    accumulates it into an fp32 zero tensor of the weight's shape before casting back: with
    a 32000 x 1024 vocabulary a transient 125 MiB that eager autograd never allocates
    (ATen accumulates in the weight's dtype), and more than LOMO keeps for a whole step at
    small batches. For a weight tied to the output projection the accumulated gradient is
    the sum of both uses' gradients; its embedding term is replaced the same way (ATen's
    rounding then matches eager's too: the decomposition sums repeated tokens in fp32, eager
    in the weight's dtype). Only the exact patterns the decomposition emits (no
    scale_grad_by_freq) are replaced; anything else is left as it is. `root` holds the
    graph's constants.
    """
    call_accumulate_grad = torch_internals.compiled_autograd_calls().accumulate_grad
    for acc in graph.find_nodes(op="call_function", target=call_accumulate_grad):
        if acc.args[0] not in hooked:
            continue
        for grad in _gradient_terms(_accumulated_grad(acc)):
            _replace_decomposition(graph, grad, root)


def _gradient_terms(grad: Any) -> list[Any]:
    """`grad`, and the two terms if it is a plain sum (a weight with two uses)."""
    total = _call_args(grad, torch.ops.aten.add.Tensor, 2)
    if total and grad.kwargs.get("alpha", 1) == 1 and len(grad.args) == 2:
        return [grad, *total]
    return [grad]


def _replace_decomposition(graph: torch.fx.Graph, grad: Any, root: Any) -> None:
    """Replaces `grad` by ATen's embedding backward if it is the narrowed decomposition."""
    narrow = _call_args(grad, torch.ops.prims.convert_element_type.default, 2)
    if not narrow or narrow[1] not in (torch.bfloat16, torch.float16):
        return
    found = _decomposed_embedding_backward(narrow[0], root)
    if found is None:
        return
    grad_output, indices, num_weights, padding_idx, zeros = found
    if len(zeros.users) != 1 or len(narrow[0].users) != 1:
        return
    with graph.inserting_before(grad):
        eager = graph.call_function(
            torch.ops.lomo_kernels.embedding_dense_backward_eager.default,
            (grad_output, indices, num_weights, padding_idx),
        )
    grad.replace_all_uses_with(eager)
    _drop_unused(graph, root, (grad, narrow[0], zeros))
    # The rest of the decomposition is now unused; compiled autograd's dce removes it.


def _drop_unused(graph: torch.fx.Graph, root: Any, nodes: tuple[Any, ...]) -> None:
    """Erases `nodes` (in order) once unused, and the root's constant behind an erased
    get_attr: the capture's root module lives as long as its compiled graph is cached
    (the runtime wrapper keeps the capturing instance), and would keep the constant with
    it (see `patch_backward_loading` for where such a constant comes from)."""
    for node in nodes:
        if not isinstance(node, torch.fx.Node) or node.users:
            return
        target = str(node.target) if node.op == "get_attr" else None
        graph.erase_node(node)
        if target and hasattr(root, target) and not graph.find_nodes(op="get_attr", target=target):
            delattr(root, target)
