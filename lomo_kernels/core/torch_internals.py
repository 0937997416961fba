"""torch's and Triton's private names: every one the package reads is read here.

Each is looked up when first needed, never at import, and always with ``getattr(owner,
name, default)`` or `_import_module` (a private module), so a release that renames or
drops one cannot break ``import lomo_kernels``. Missing, a name either has a fallback that
needs no private name (the eager fast path is not taken, a graph pattern is not matched, a
refusal is not recognised and torch's own error surfaces), or its user gets a
`MissingInternalError` naming it, the running version and what to do.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, NamedTuple

import torch

from .autograd_graph import graph_nodes

_COMPILED_AUTOGRAD = "torch._dynamo.compiled_autograd"


class MissingInternalError(RuntimeError):
    """A private torch or Triton name the package needs is missing from the running version."""

    def __init__(self, name: str, remedy: str) -> None:
        library, version = _library_version(name)
        super().__init__(
            f"lomo_kernels needs {name}, which {library} {version} does not have: {remedy}"
        )
        self.name = name


def _library_version(name: str) -> tuple[str, str]:
    """('torch' or 'triton', its running version) for a dotted name from that library."""
    if name.split(".")[0] != "triton":
        return "torch", str(torch.__version__)
    try:
        import triton
    except ImportError:
        return "triton", "(not importable)"
    return "triton", str(getattr(triton, "__version__", "(unknown version)"))


def _import_module(name: str) -> ModuleType | None:
    """The module `name`, or None where it does not exist."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _read(module: str, name: str) -> Any:
    """Attribute `name` of module `module`, or None where either is missing."""
    found = _import_module(module)
    return None if found is None else getattr(found, name, None)


def _require(module: str, name: str, remedy: str) -> Any:
    """Attribute `name` of module `module`; `MissingInternalError` where either is missing."""
    found = _read(module, name)
    if found is None:
        raise MissingInternalError(f"{module}.{name}", remedy)
    return found


# ---------------------------------------------------------------------- eager fast path


class DispatcherBypass(NamedTuple):
    """What the eager fast path reads of torch's dispatcher state, and the one thing it does
    in the dispatcher's stead.

    `available` is False where this torch lacks any of it: `nothing_listening` then always
    says False and `any_requires_grad` True, so every call goes through the dispatcher.
    """

    available: bool
    # No TorchDispatch or TorchFunction mode, torch.func transform, profiler, JIT tracer
    # or functionalization active on this thread.
    nothing_listening: Callable[[], bool]
    any_requires_grad: Callable[..., bool]
    # The version bump ADInplaceOrView does for the tensors an op mutates.
    increment_version: Callable[[Iterable[torch.Tensor]], None]


def _never_reached(tensors: Iterable[torch.Tensor]) -> None:
    # nothing_listening says False without these names: no fast call gets this far.
    raise MissingInternalError("torch._C._increment_version", "call the op through torch.ops")


_DISPATCHER_ONLY = DispatcherBypass(False, lambda: False, lambda *tensors: True, _never_reached)


@functools.cache
def dispatcher_bypass() -> DispatcherBypass:
    """The eager fast path's reads of torch's thread state (found once, then kept)."""
    C = getattr(torch, "_C", None)
    reads = [
        getattr(C, name, None)
        for name in (
            "_len_torch_dispatch_stack",
            "_is_torch_function_mode_enabled",
            "_are_functorch_transforms_active",
            "_is_tracing",
            "_dispatch_tls_is_dispatch_key_included",
            "_any_requires_grad",
            "_increment_version",
        )
    ]
    profiler_enabled = getattr(getattr(C, "_autograd", None), "_profiler_enabled", None)
    functionalize = getattr(getattr(C, "DispatchKey", None), "Functionalize", None)
    if None in reads or profiler_enabled is None or functionalize is None:
        return _DISPATCHER_ONLY
    dispatch_modes, function_modes, transforms, tracing, key_included = reads[:5]
    any_requires_grad, increment_version = reads[5:]

    # Bound as locals: each eager op call runs this, and lookups on torch._C cost.
    def nothing_listening() -> bool:
        return not (
            dispatch_modes()
            or function_modes()
            or transforms()
            or profiler_enabled()
            or tracing()
            or key_included(functionalize)
        )

    return DispatcherBypass(True, nothing_listening, any_requires_grad, increment_version)


# ---------------------------------------------------------------------- compiled autograd


def compiled_autograd_enabled() -> bool:
    """Whether a backward started now would be traced by compiled autograd: inside its
    enabling context, or with ``torch._dynamo.config.compiled_autograd`` set. A switch this
    torch lacks counts as off (`compiled_autograd_state_readable` tells).

    Only attribute reads on modules, so a compiled training step traces it without a break.
    """
    dynamo = getattr(torch, "_dynamo", None)
    return bool(
        getattr(getattr(dynamo, "compiled_autograd", None), "compiled_autograd_enabled", False)
        or getattr(getattr(dynamo, "config", None), "compiled_autograd", False)
    )


@functools.cache
def compiled_autograd_state_readable() -> bool:
    """Whether this torch has both switches `compiled_autograd_enabled` reads (where it
    lacks one, that compiled autograd is on cannot be told)."""
    dynamo = getattr(torch, "_dynamo", None)
    flags = (
        getattr(getattr(dynamo, "compiled_autograd", None), "compiled_autograd_enabled", None),
        getattr(getattr(dynamo, "config", None), "compiled_autograd", None),
    )
    return None not in flags


def enable_compiled_autograd(compiler: Callable[..., Any]) -> Any:
    """A context in which backwards are traced by compiled autograd and compiled by
    `compiler` (as ``torch.compile(backend=...)`` returns it)."""
    enable = _require(
        _COMPILED_AUTOGRAD,
        "_enable",
        "run the backward without compiled autograd, or set "
        "torch._dynamo.config.compiled_autograd = True around a compiled step",
    )
    return enable(compiler)


_PATCH_REMEDY = (
    "run the backward without compiled autograd (torch.compile of the forward alone is supported)"
)


def compiled_autograd_capture_class() -> type:
    """The class whose instance captures one backward for compiled autograd (its capture
    steps are what `lomo_kernels.compile.scope` adjusts)."""
    return _require(_COMPILED_AUTOGRAD, "AutogradCompilerInstance", _PATCH_REMEDY)


class CompiledAutogradCalls(NamedTuple):
    """The targets compiled autograd's graph calls for an AccumulateGrad node and a hook."""

    accumulate_grad: Callable[..., Any]
    hook: Callable[..., Any]


@functools.cache
def compiled_autograd_calls() -> CompiledAutogradCalls:
    """The targets of AccumulateGrad and hook calls in compiled autograd's graphs."""
    module = "torch._dynamo.external_utils"
    return CompiledAutogradCalls(
        _require(module, "call_accumulate_grad", _PATCH_REMEDY),
        _require(module, "call_hook", _PATCH_REMEDY),
    )


def backward_graph_extractor() -> Callable[[Any], Any] | None:
    """Compiled autograd's function rebuilding a compiled forward's AOT backward graph at
    capture; None where this torch has none."""
    return _read(_COMPILED_AUTOGRAD, "extract_bw_module")


def set_backward_graph_extractor(extract: Callable[[Any], Any]) -> None:
    """Makes compiled autograd rebuild AOT backward graphs with `extract`."""
    module = _import_module(_COMPILED_AUTOGRAD)
    if module is not None:
        module.extract_bw_module = extract  # type: ignore[attr-defined]


def serialized_backward_loader(compiled_function: Any) -> Any:
    """The loader of a compiled forward's backward graph as AOTAutograd's cache keeps it
    (a bound method of the serialized graph), or None."""
    return getattr(getattr(compiled_function, "_lazy_backward_info", None), "bw_module_fn", None)


def outside_fake_tensor_mode() -> Any:
    """A context in which tensors are made real even inside a FakeTensorMode (torch's own
    loader of backward graphs runs in one); None where this torch has none."""
    unset = _read("torch._subclasses.fake_tensor", "unset_fake_temporarily")
    return None if unset is None else unset()


def capture_internals_missing() -> MissingInternalError | None:
    """What this torch lacks of the internals the compiled-autograd adjustment uses, or None
    when it has them all (checked before any of it is patched)."""
    try:
        compiled_autograd_capture_class()
        compiled_autograd_calls()
        inductor_config()
        inductor_graph_lowering()
        inductor_custom_graph_pass()
        op_schema(torch.ops.aten.add.Tensor)
        if op_overload_class() is None:
            raise MissingInternalError("torch._ops.OpOverload", _PATCH_REMEDY)
    except MissingInternalError as missing:
        return missing
    return None


# ---------------------------------------------------------------------- Inductor and op schemas


def inductor_config() -> ModuleType:
    """``torch._inductor.config`` (read and patched while compiling our captures)."""
    config = _import_module("torch._inductor.config")
    if config is None:
        raise MissingInternalError("torch._inductor.config", _PATCH_REMEDY)
    return config


def inductor_graph_lowering() -> type:
    """Inductor's lowering of an FX graph (``GraphLowering``)."""
    return _require("torch._inductor.graph", "GraphLowering", _PATCH_REMEDY)


def inductor_custom_graph_pass() -> tuple[type, Callable[..., bytes]]:
    """(Inductor's base class of a custom graph pass, its hash of source files)."""
    module = "torch._inductor.custom_graph_pass"
    return (
        _require(module, "CustomGraphPass", _PATCH_REMEDY),
        _require(module, "get_hash_for_files", _PATCH_REMEDY),
    )


@functools.cache
def op_overload_class() -> type | None:
    """The class of one overload of an operator (``torch.ops.aten.mm.default``), or None."""
    return _read("torch._ops", "OpOverload")


def is_op_overload(target: Any) -> bool:
    """Whether `target` (an FX node's) is one overload of an operator."""
    overload = op_overload_class()
    return overload is not None and isinstance(target, overload)


def op_schema(op: Any) -> Any:
    """The schema of operator overload `op` (``torch._C.FunctionSchema``)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        raise MissingInternalError("torch._ops.OpOverload._schema", _PATCH_REMEDY)
    return schema


def _aten_overload(name: str) -> Any:
    """``torch.ops.aten.<name>.default``, or None where this torch has no such op."""
    return getattr(getattr(torch.ops.aten, name, None), "default", None)


def unsafe_index_put_op() -> Any:
    """ATen's unchecked ``index_put`` (the embedding backward's decomposition before 2.12)."""
    return _aten_overload("_unsafe_index_put")


def unsafe_masked_index_put_accumulate_op() -> Any:
    """ATen's masked accumulating ``index_put`` (that decomposition from torch 2.12 on)."""
    return _aten_overload("_unsafe_masked_index_put_accumulate")


def auto_functionalized_bases(node: torch.fx.Node) -> tuple[Any, ...]:
    """The tensors an ``auto_functionalized_v2`` node writes (its bases), or () where the
    node does not say."""
    return tuple(node.kwargs.get("_all_bases", ()))


# ---------------------------------------------------------------------- failures, recognised


def is_backend_compiler_failure(error: BaseException) -> bool:
    """Whether `error` is torch.compile's report of a compiler backend that failed on a
    graph. Where this torch has no such type, any Exception counts."""
    failed = _read("torch._dynamo.exc", "BackendCompilerFailed")
    return isinstance(error, failed if isinstance(failed, type) else Exception)


def compiled_backward_donates_buffers(loss: torch.Tensor) -> bool:
    """Whether `loss`'s graph holds a compiled forward whose compiled backward reuses the
    buffers it saved (AOTAutograd's donated buffers) while torch has them on: torch then runs
    that backward only once and refuses to keep the graph (``retain_graph=True``)."""
    config = _import_module("torch._functorch.config")
    if not getattr(config, "donated_buffer", False):
        return False
    for node in graph_nodes(loss.grad_fn):
        compiled = getattr(type(node), "_forward_cls", None)
        if getattr(getattr(compiled, "metadata", None), "bw_donated_idxs", None):
            return True
    return False


# ---------------------------------------------------------------------- autograd and modules


def saved_sparse(node: Any) -> bool:
    """Whether an autograd node of an op that may give sparse gradients (an embedding lookup's
    `sparse`, torch.gather's `sparse_grad`) gives one (False where the node does not say)."""
    return bool(getattr(node, "_saved_sparse", False) or getattr(node, "_saved_sparse_grad", False))


def post_accumulate_grad_hooks(param: torch.Tensor) -> dict[Any, Callable[..., Any]]:
    """The post-accumulate-grad hooks registered on `param` (empty where unreadable)."""
    return getattr(param, "_post_accumulate_grad_hooks", None) or {}


def non_persistent_buffer_names(module: torch.nn.Module) -> Iterable[str]:
    """Names of `module`'s own buffers left out of its state_dict."""
    found = getattr(module, "_non_persistent_buffers_set", None)
    if found is not None:
        return found
    kept = module.state_dict(keep_vars=True)
    return {name for name, _ in module.named_buffers(recurse=False) if name not in kept}


def fsdp_param_group(module: torch.nn.Module) -> Any:
    """The FSDP2 parameter group of a module that ``fully_shard`` wrapped, or None."""
    get_state = getattr(module, "_get_fsdp_state", None)
    return None if get_state is None else getattr(get_state(), "_fsdp_param_group", None)


def custom_op_overload(op: Any, qualname: str) -> Any:
    """The operator overload that ``torch.library.custom_op`` registered as `qualname`
    ("namespace::name") for `op`: what the dispatcher runs."""
    overload = getattr(op, "_opoverload", None)
    if overload is not None:
        return overload
    namespace, name = qualname.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


# ---------------------------------------------------------------------- tensor lists


def copy_each_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every i: one op for the whole list (on a GPU, a
    launch or a few rather than one per tensor) where torch has ``torch._foreach_copy_``,
    else one copy each."""
    copy_all = getattr(torch, "_foreach_copy_", None)
    if copy_all is not None:
        copy_all(targets, sources)
        return
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


# ---------------------------------------------------------------------- oneDNN


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (False where torch cannot say)."""
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    return check is not None and bool(check())


# ---------------------------------------------------------------------- Triton


def triton_reduce_combines() -> tuple[Any, Any]:
    """triton.language's own max and sum combine functions, for ``tl.reduce``: the
    interpreter recognises these two and reduces with NumPy, and they work whichever mode
    triton was imported in (``tl.max`` / ``tl.sum`` do not)."""
    standard = _import_module("triton.language.standard")
    combines = (
        getattr(standard, "_elementwise_max", None),
        getattr(standard, "_sum_combine", None),
    )
    for name, combine in zip(("_elementwise_max", "_sum_combine"), combines, strict=True):
        if combine is None:
            raise MissingInternalError(
                f"triton.language.standard.{name}",
                "use backend='cpp' or backend='torch', or a triton release that has it",
            )
    return combines


def triton_current_stream() -> Callable[[int], int] | None:
    """Triton's reader of a CUDA device's current stream (the stream its JIT launches on),
    or None where this triton has none (launches then go through the JIT)."""
    driver = _read("triton.runtime.driver", "driver")
    try:
        return getattr(driver.active, "get_current_stream", None)
    except Exception:  # no GPU driver in this triton, or none usable here
        return None
