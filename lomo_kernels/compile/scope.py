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

`install` wraps four of compiled autograd's capture steps. Each acts only on a backward
whose inputs include a parameter that one of this package's optimizers updates in its hooks
("ours"); any other backward, and any other hook in ours, gets torch's own code unchanged:
- `begin_capture` notes which graph inputs are ours and which share storage (a weight and
  its saved copy);
- `reorder_accumulate_grad_nodes` leaves the AccumulateGrad nodes that carry
  post-accumulate-grad hooks where eager autograd runs them (after the producing node);
- after `reorder_post_acc_grad_hook_nodes`, each such node and its hooks move up to just
  after the last read of the weight or of anything that may alias it (inputs on the same
  storage, the AOT backward's saved copy, views; an unknown callable's result counts as an
  alias), so the gradient is freed as early as eager LOMO frees it. When an input's storage
  cannot be read (tensor subclasses) the eager position stays. A bf16/fp16 embedding's
  gradient is computed by ATen's embedding backward there, not by the fp32 decomposition
  a compiled forward leaves (`_use_eager_embedding_backward`);
- `end_capture`: the graph's Inductor compile runs without `reorder_for_locality`, with
  `delay_updates_past_reads`, and with `_realizing_reads_before_writes`, so that each
  update stays after every read of its weight in the code Inductor emits. Otherwise
  Inductor clones the weights it updates and copies them back at the end of the graph
  (seen: every weight, the model held twice) and, once the clones are gone, fuses an
  elementwise read of a weight (RMSNorm's ``dy * weight``) into a kernel it runs after the
  update (seen: every gradient below the final norm off by about 1e-3 of the update).
These only decide what Inductor schedules where; the order compiled autograd traced, which
decides what is computed, is the one set above. `check_supported` and the refusal of an
eager forward stop the set-ups that cannot be made correct, before any parameter is written.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
from collections.abc import Callable, Iterator
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

# Versions on which compiled autograd with these patches is tested (`make
# test-compile-versions`). Matched by major.minor: the private capture and Inductor APIs
# patched here change between minor releases, while patch releases carry targeted fixes
# only; local suffixes (+cpu, +cu128) are builds of the same code.
TESTED_TORCH_VERSIONS = ("2.11.0", "2.13.0")
TORCH_VERSION = str(torch.__version__)  # the version `check_supported` judges

UNTESTED_MESSAGE = (
    "lomo_kernels: compiled autograd is enabled, but torch {version} is not a version on "
    "which lomo_kernels tests its in-backward updates under compiled autograd (tested: "
    "{tested}, and their patch releases); they could be silently wrong, so nothing was "
    "updated. Eager backward and torch.compile of the forward alone keep working on any "
    "version: run the backward without compiled autograd."
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


def _series(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as 2.13.0+cpu; None if it has none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def torch_version_tested(version: str) -> bool:
    """Whether `version` is a patch release of one of TESTED_TORCH_VERSIONS."""
    series = _series(version)
    return series is not None and series in {_series(v) for v in TESTED_TORCH_VERSIONS}


def _our_inputs(inputs: list[Any], owned: Callable[[Any], bool]) -> set[int]:
    """Indices of the capture's inputs that are parameters our hooks update."""
    return {i for i, t in enumerate(inputs) if owned(t)}


def _our_hooked_params(instance: Any, call_hook: Any) -> set[torch.fx.Node]:
    """The graph's parameters that carry a post-accumulate-grad hook and are ours."""
    ours = getattr(instance, "_lomo_ours", set())
    return {
        p for p in _hooked_params(instance.fx_tracer.graph, call_hook) if _input_index(p) in ours
    }


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
            self._lomo_input_storages = [_storage_key(t) for t in inputs]
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
        _use_eager_embedding_backward(graph, hooked, self.fx_tracer.root)
        storages = getattr(self, "_lomo_input_storages", None)
        if storages is not None:
            _move_updates_after_last_read(graph, storages, hooked, call_hook)

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
                passes: Any = _DELAY_UPDATES.get()
            elif isinstance(user_passes, list | tuple):
                passes = [*user_passes, _DELAY_UPDATES.get()]
            else:
                passes = [user_passes, _DELAY_UPDATES.get()]
            # reorder_for_locality would move reads of each weight next to their consumers,
            # after the update compiled autograd placed behind them, undoing that placement.
            with (
                inductor_config.patch(
                    post_grad_custom_post_pass=passes, reorder_for_locality=False
                ),
                _realizing_reads_before_writes(),
            ):
                return compiled(*args, **kwargs)

        return runtime_wrapper, compiled_with_pass

    owner.begin_capture = begin_capture_noting_storages
    _patch_backward_loading()
    owner.reorder_accumulate_grad_nodes = reorder_accumulate_grad_nodes
    owner.reorder_post_acc_grad_hook_nodes = reorder_post_acc_grad_hook_nodes
    owner.end_capture = end_capture_with_inductor_pass
    return True


_lowering_patched = False  # `_realizing_reads_before_writes` is active (not re-entrant)


@contextlib.contextmanager
def _realizing_reads_before_writes() -> Iterator[None]:
    """Inductor lowering in which every pending read of a buffer is realized *before* an op
    that writes the buffer in place, not after it.

    Inductor keeps an elementwise read of a weight (RMSNorm's ``dy * weight``) unrealized, to
    inline it into whichever kernel consumes it. When a fallback kernel then mutates the
    weight (our update ops), ``MutationOutput`` calls ``GraphLowering.mark_buffer_mutated``,
    which realizes those pending reads, but only after the mutating kernel has been
    registered as an operation: the scheduler then orders the realized read after the
    update, and the kernel it is fused into reads the *updated* weight (torch 2.13; seen as
    the final norm's weight read after its update, every gradient below it off by about
    lr * grad / weight, 1e-3 of the update). Here the same realization
    runs just before the op is lowered, so the reads are registered, and scheduled, first.
    It realizes what torch's lowering realizes there anyway, only earlier.
    """
    global _lowering_patched
    from torch._inductor.graph import GraphLowering

    if _lowering_patched:
        yield
        return
    call_function = GraphLowering.call_function

    @functools.wraps(call_function)
    def realize_then_call(self: Any, target: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            users = getattr(self, "name_to_users", {})
            for name in _written_buffers(target, args, kwargs):
                for user in list(users.get(name, ())):
                    user.realize()
        return call_function(self, target, args, kwargs)

    GraphLowering.call_function = realize_then_call
    _lowering_patched = True
    try:
        yield
    finally:
        GraphLowering.call_function = call_function
        _lowering_patched = False


def _written_buffers(target: torch._ops.OpOverload, args: Any, kwargs: Any) -> list[str]:
    """Names of the Inductor buffers that `target` writes in place, given its lowered args."""
    names = []
    for i, argument in enumerate(target._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.name in kwargs:
            value = kwargs[argument.name]
        elif i < len(args) and not argument.kwarg_only:
            value = args[i]
        else:
            continue
        for item in value if isinstance(value, list | tuple) else (value,):
            get_name = getattr(item, "get_name", None)
            if callable(get_name):
                try:
                    names.append(get_name())
                except (AttributeError, NotImplementedError):
                    continue
    return names


def _patch_backward_loading() -> None:
    """Makes compiled autograd rebuild a cached AOT backward graph from a copy of its state.

    A compiled forward loaded from AOTAutograd's cache keeps its backward graph serialized;
    compiled autograd rebuilds it at capture by symbolic tracing, which runs a factory call
    with constant arguments eagerly and stores the result as an attribute of the module
    being traced. That module's attribute dict is the cached state itself, so the tensor
    stays alive as long as the compiled forward: for the embedding backward's ``full(shape,
    0)`` an fp32 tensor of the embedding's shape (125 MiB for 32000 x 1024), on the
    weight's device. Rebuilt from a copy, the tensor lives only during the capture (the
    graph no longer reads it once `_use_eager_embedding_backward` has run).
    """
    from torch._dynamo import compiled_autograd
    from torch.fx.graph_module import reduce_graph_module

    extract = getattr(compiled_autograd, "extract_bw_module", None)
    if not callable(extract) or getattr(extract, "_lomo_copies_state", False):
        return

    @functools.wraps(extract)
    def extract_from_copy(compiled_function: Any) -> Any:
        if not _capturing_ours:
            return extract(compiled_function)
        loader = getattr(compiled_function._lazy_backward_info, "bw_module_fn", None)
        serialized = getattr(loader, "__self__", None)
        args = getattr(serialized, "args", None)
        if getattr(serialized, "fn", None) is not reduce_graph_module or not (
            isinstance(args, tuple) and args and isinstance(args[0], dict)
        ):
            return extract(compiled_function)
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # as torch's own loader
            return reduce_graph_module(dict(args[0]), *args[1:])

    extract_from_copy._lomo_copies_state = True  # type: ignore[attr-defined]
    compiled_autograd.extract_bw_module = extract_from_copy


@torch.library.custom_op("lomo_kernels::embedding_dense_backward_eager", mutates_args=())
def _embedding_dense_backward_eager(
    grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int
) -> torch.Tensor:
    """ATen's own embedding backward, opaque to Inductor (which would decompose it)."""
    return torch.ops.aten.embedding_dense_backward.default(
        grad, indices, num_weights, padding_idx, False
    )


@_embedding_dense_backward_eager.register_fake
def _(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int) -> Any:
    return grad.new_empty((num_weights, *grad.shape[indices.dim() :]))


def _call_args(node: Any, target: Any, count: int) -> tuple[Any, ...] | None:
    """`node`'s first `count` positional arguments if it calls `target`, else None."""
    if (
        isinstance(node, torch.fx.Node)
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
    compiled autograd rebuilds the graph (see `_patch_backward_loading`)."""
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
    aten = torch.ops.aten
    masked_put = _call_args(narrowed, aten._unsafe_masked_index_put_accumulate.default, 4)
    if masked_put:
        zeros, mask, indices, widened = masked_put
    else:
        put = _call_args(narrowed, aten.index_put.default, 4) or _call_args(
            narrowed, aten._unsafe_index_put.default, 4
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


def _use_eager_embedding_backward(
    graph: torch.fx.Graph, hooked: set[torch.fx.Node], root: Any = None
) -> None:
    """Gives each hooked embedding weight ATen's embedding backward instead of the
    decomposition a compiled forward leaves in its backward graph.

    For a bf16/fp16 weight that decomposition converts the output gradient to fp32 and
    accumulates it into an fp32 zero tensor of the weight's shape before casting back: with
    a 32000 x 1024 vocabulary a transient 125 MiB that eager autograd never allocates
    (ATen accumulates in the weight's dtype), and more than LOMO keeps for a whole step at
    small batches. Only the exact patterns the decomposition emits (no scale_grad_by_freq)
    are replaced; anything else is left as it is. `root` holds the graph's constants.
    """
    from torch._dynamo.external_utils import call_accumulate_grad

    for acc in graph.find_nodes(op="call_function", target=call_accumulate_grad):
        if acc.args[0] not in hooked:
            continue
        grad = _accumulated_grad(acc)
        narrow = _call_args(grad, torch.ops.prims.convert_element_type.default, 2)
        if not narrow or narrow[1] not in (torch.bfloat16, torch.float16):
            continue
        found = _decomposed_embedding_backward(narrow[0], root)
        if found is None:
            continue
        grad_output, indices, num_weights, padding_idx, zeros = found
        if len(zeros.users) != 1 or len(narrow[0].users) != 1:
            continue
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
    it (see `_patch_backward_loading` for where such a constant comes from)."""
    for node in nodes:
        if not isinstance(node, torch.fx.Node) or node.users:
            return
        target = str(node.target) if node.op == "get_attr" else None
        graph.erase_node(node)
        if target and hasattr(root, target) and not graph.find_nodes(op="get_attr", target=target):
            delattr(root, target)


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
    from torch._dynamo.external_utils import call_accumulate_grad

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


_HOP = torch.ops.higher_order
# Ops Inductor runs as a kernel of their own, writing a realized buffer: a read of a weight
# by one of them happens where the op is scheduled, never later inside a fused consumer.
_EXTERN_ATEN = frozenset(
    {
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "convolution",
        "convolution_backward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
    }
)


def _reads_in_place(node: torch.fx.Node) -> bool:
    """Whether `node` reads its inputs where it runs (an extern kernel); other ops may be
    inlined by Inductor into whichever consumer it schedules, possibly much later."""
    target = node.target
    if target in (_HOP.auto_functionalized_v2, _HOP.auto_functionalized):
        return True
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace not in ("aten", "prims"):
            return True  # custom ops: fallback kernels
        return target._schema.name.split("::")[-1] in _EXTERN_ATEN
    return False


def delay_updates_past_reads(graph: torch.fx.Graph) -> int:
    """Inductor post-grad pass: moves each functionalized update of a graph input after every
    computation that may still read the input's old value. Returns the number moved.

    The graph is functional here, so the order changes nothing that is computed, only what
    Inductor makes of it. Where a read of a weight W comes after the update of W:
    - the re-inplacing pass cannot update W in place: Inductor clones W for the update and
      copies it back at the end of the graph, holding that weight twice;
    - where the read is an elementwise op that Inductor inlines into a consumer scheduled
      after the update (RMSNorm's ``dy * weight`` feeding a later reduction), the consumer
      reads the updated W: on torch 2.13 the realization meant to prevent it registers the
      read after the mutating kernel. Seen as AdaLomo steps 1% off once the clones are gone.
    So the reads are followed through every op that may be inlined, up to ops that read
    where they run (matmuls, attention, custom ops), and the update, with whatever depends
    on it up to there, is placed after the last of them. Where a read depends on the update
    nothing moves: the updates are chained through their shared found_inf flag, so a read
    that reaches a later update (the residual stream's gradient, elementwise down to the
    embedding's) cannot be passed. Such an update stays where it is, in place, and
    `_realizing_reads_before_writes` keeps its inlined reads ahead of it.
    """
    copy_ = torch.ops.aten.copy_.default
    order = {node: i for i, node in enumerate(graph.nodes)}
    moved = 0
    for update in list(graph.find_nodes(op="call_function", target=_HOP.auto_functionalized_v2)):
        bases = [
            b
            for b in update.kwargs.get("_all_bases", ())
            if isinstance(b, torch.fx.Node) and b.op == "placeholder"
        ]
        if not bases:
            continue
        reads: set[torch.fx.Node] = set()
        stack = list(bases)
        while stack:
            for user in stack.pop().users:
                if user in reads or user is update or user.op == "output" or user.target is copy_:
                    continue
                reads.add(user)
                if not _reads_in_place(user):
                    stack.append(user)
        if not reads:
            continue
        last = max(reads, key=order.__getitem__)
        if order[last] < order[update]:
            continue
        # What depends on the update up to `last` moves with it, in its order: the updates
        # chained through a shared found_inf flag, for one.
        cone = {update}
        for node in nodes_between(update, last):
            if any(a in cone for a in node.all_input_nodes):
                cone.add(node)
        if cone & reads:
            continue  # a read of the old value depends on the update: Inductor clones
        anchor = last
        for node in sorted(cone, key=order.__getitem__):
            anchor.append(node)
            anchor = node
        moved += 1
        order = {node: i for i, node in enumerate(graph.nodes)}
    return moved


def nodes_between(first: torch.fx.Node, last: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes after `first` up to and including `last`, in graph order."""
    out = []
    node = first.next
    while node is not last:
        out.append(node)
        node = node.next
    out.append(last)
    return out


def _delay_updates_pass() -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class DelayUpdatesPastReads(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            delay_updates_past_reads(graph)

        def uuid(self) -> bytes:
            # Inductor's FX graph cache keys on this: the pass's source.
            return get_hash_for_files((__file__,))

    return DelayUpdatesPastReads()


class _LazyPass:
    """Builds the Inductor pass object on first use (importing Inductor only then)."""

    def __init__(self) -> None:
        self._pass: Any = None

    def get(self) -> Any:
        if self._pass is None:
            self._pass = _delay_updates_pass()
        return self._pass


_DELAY_UPDATES = _LazyPass()


def compiled_autograd_active() -> bool:
    """Whether a backward started now would be traced by compiled autograd."""
    from torch._dynamo import compiled_autograd

    return bool(
        getattr(compiled_autograd, "compiled_autograd_enabled", False)
        or torch._dynamo.config.compiled_autograd
    )


def check_supported() -> None:
    """Raises before any update when compiled autograd is on and this torch is untested or
    the fix is unavailable.

    Reads only module state, so a compiled training step can trace it without a break.
    """
    if not compiled_autograd_active():
        return
    if not torch_version_tested(TORCH_VERSION):
        tested = ", ".join(TESTED_TORCH_VERSIONS)
        raise RuntimeError(UNTESTED_MESSAGE.format(version=TORCH_VERSION, tested=tested))
    if not _installed:
        raise RuntimeError(UNSUPPORTED_MESSAGE.format(version=TORCH_VERSION))


def is_aliased_input_failure(error: BaseException) -> bool:
    """AOTAutograd's refusal of an in-place update of an input whose views are inputs too."""
    text = f"{error}\n{error.__cause__}"
    return "any_leaf" in text and "all_leaf" in text
