"""Machinery shared by Lomo and AdaLomo: per-parameter hooks that update inside backward.

Each trainable parameter gets one post-accumulate-grad hook. During `fused_backward` the hook
updates that parameter with a fused op and frees its gradient; during `grad_norm` it only
accumulates the gradient's squared norm and inf/nan flag on the device. Flags, norms, clip
coefficients, the loss scale and the learning rate stay in device tensors, so backward never
waits for the host. A step's overflow is copied to the host without blocking and reported
at the next call.
"""

from __future__ import annotations

import abc
import functools
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import compile as _compiled_autograd
from .. import ops
from ..distributed import (
    DEFAULT_BUCKET_NUMEL,
    Shard,
    compute_dtypes,
    sharding_for,
    unwrap_engine,
)
from ..ops.backends import requested_backend
from ..ops.checks import SUPPORTED_DTYPES
from ..ops.scalars import optional_factor
from ._hyper import (
    CHECKS,
    check_lr,
    checked_group,
    checked_groups,
)
from .loss_scaler import LOSS_SCALE_KEYS, DynamicLossScaler, check_scaler_state
from .single_pass import PARTIAL_STEP_WARNING, SinglePassClip

SERVED_DEVICE_TYPES = ("cpu", "cuda")

GRAD_ACCUMULATION_ERROR = (
    "LOMO updates each parameter inside backward and frees its gradient at once, so "
    "gradients cannot be accumulated over micro-batches. Call optimizer.fused_backward(loss) "
    "(or grad_norm(loss) first) instead of loss.backward(), once per optimizer step, and use "
    "a larger batch instead of gradient accumulation. With transformers.Trainer or accelerate "
    "call lomo_kernels.enable_transformers() first, or use "
    "lomo_kernels.integrations.hf_trainer.LomoTrainer."
)

_IDLE, _NORM, _UPDATE = "idle", "norm", "update"

# The param-group keys of lomo-optim 0.1.1's state_dict(), by class: its torch.optim
# defaults (it keeps AdaLomo's moments and step count outside the state, so they are absent).
LOMO_OPTIM_GROUP_KEYS = {
    "Lomo": frozenset({"lr", "clip_grad_norm", "clip_grad_value"}),
    "AdaLomo": frozenset({"lr", "eps", "weight_decay", "clip_grad_norm", "clip_grad_value"}),
}


def lomo_optim_writer(state_dict: Any) -> str | None:
    """The lomo-optim class that wrote `state_dict` (no 'lomo' entry, no per-parameter state,
    one group with exactly its keys), or None."""
    if not isinstance(state_dict, dict) or "lomo" in state_dict or state_dict.get("state") != {}:
        return None
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], dict):
        return None
    if not isinstance(groups[0].get("params"), list):
        return None
    keys = set(groups[0]) - {"params"}
    return next((name for name, own in LOMO_OPTIM_GROUP_KEYS.items() if keys == own), None)


@dataclass
class _DeviceScalars:
    """Per-device 1-element fp32 tensors the kernels read (one set per device in use)."""

    device: torch.device
    sumsq: torch.Tensor = field(init=False)
    norm_found_inf: torch.Tensor = field(init=False)
    update_found_inf: torch.Tensor = field(init=False)
    no_skip: torch.Tensor = field(init=False)
    clip_coef: torch.Tensor = field(init=False)
    inv_scale: torch.Tensor = field(init=False)  # the loss scaler's, copied once per step
    lr: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def zeros() -> torch.Tensor:
            return torch.zeros(1, device=self.device)

        self.sumsq, self.norm_found_inf, self.update_found_inf = zeros(), zeros(), zeros()
        self.no_skip, self.clip_coef = zeros(), torch.ones(1, device=self.device)
        self.inv_scale = torch.ones(1, device=self.device)


def _for_hooks(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked group hyper-parameters without lr, as plain dicts for the hooks.

    torch.compile guards on every value of an optimizer's param_groups, so reading the
    groups inside a traced hook would recompile the backward whenever the lr changes (the
    hooks take the lr from scalars.lr).
    """
    return [{k: v for k, v in group.items() if k != "lr"} for group in groups]


ONE_LOSS_UNDER_SHARDING = (
    "under ZeRO-3 the graph of a loss cannot be back-propagated twice (DeepSpeed releases the "
    "gathered parameters after the first backward), so the norm pass (clip_grad_norm, or "
    "fp16 overflow detection) needs its own forward: call opt.grad_norm(model(x)) and then "
    "opt.fused_backward(model(x)) with the same batch, once per step"
)


def parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters (tied ones once), after checking every one can be served.

    A DeepSpeed engine is accepted in place of its module.
    """
    model = unwrap_engine(model)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"pass the model (an nn.Module), not {type(model).__name__}: LOMO registers a hook "
            "on each of its trainable parameters"
        )
    refuse_sparse_embeddings(trained_embeddings(model))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "the model has no trainable parameters (requires_grad=True): "
            "nothing for the optimizer to update"
        )
    names = parameter_names(model)
    for p in params:
        name = names.get(id(p), "?")
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"parameter {name!r} has dtype {p.dtype}; the fused kernels update "
                "float32, float16 and bfloat16 parameters: cast the model first"
            )
        if p.device.type not in SERVED_DEVICE_TYPES:
            raise ValueError(
                f"parameter {name!r} is on {p.device}, which no lomo_kernels "
                f"backend serves ({', '.join(SERVED_DEVICE_TYPES)}); move the "
                "model (a meta-device model must be materialised first)"
            )
        if p.layout != torch.strided or not p.is_contiguous():
            raise ValueError(
                f"parameter {name!r} is not a contiguous dense tensor; "
                "make it contiguous before building the optimizer"
            )
    return params


def trained_embeddings(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The embedding modules whose weight is trainable, with their names: their `sparse`
    flag is read again before each step (it may be set after construction)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.weight.requires_grad
    ]


def refuse_sparse_embeddings(embeddings: list[tuple[str, nn.Module]]) -> None:
    """A sparse gradient would reach the hooks only after other tensors were updated."""
    for name, module in embeddings:
        if module.sparse:
            raise ValueError(
                f"module {name!r} produces sparse gradients (sparse=True); LOMO updates dense "
                f"parameters in place: set {name or 'the module'}.sparse = False (or construct "
                "it with sparse=False)"
            )


_SPARSE_GRADIENT_NODES = ("EmbeddingBackward0", "EmbeddingBagBackward0")


def sparse_embedding_in_graph(loss: torch.Tensor) -> bool:
    """Whether the backward of `loss` holds an embedding lookup with sparse=True (the
    functional form, F.embedding(..., sparse=True), that no module flag shows).

    A walk of the autograd graph on the host, about 1.3 us per node (seen: 0.13 ms for a
    2-layer LLaMA, 3.3 ms for a 32-layer one); run only for steps without a norm pass, where
    the sparse gradient would otherwise arrive after other tensors were updated.
    """
    stack = [loss.grad_fn]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name() in _SPARSE_GRADIENT_NODES and getattr(node, "_saved_sparse", False):
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def sparse_gradient_error(name: str) -> TypeError:
    return TypeError(
        f"parameter {name!r} received a sparse gradient (F.embedding(..., sparse=True) or "
        "another op with sparse gradients in the forward); LOMO updates dense parameters in "
        "place: pass sparse=False"
    )


def interruption_note(updated: list[str], total: int, tracked: bool) -> str:
    """The note added to an exception raised during an update pass."""
    if not tracked:
        return (
            "lomo_kernels: the update pass ran under compiled autograd, where the optimizer "
            "cannot tell which parameters were updated before this error: treat the model as "
            "partly stepped and reload a checkpoint (model and optimizer state_dict)"
        )
    if not updated:
        return (
            "lomo_kernels: raised during the update pass before any parameter was updated: "
            "the model and the optimizer state are unchanged"
        )
    shown = ", ".join(updated[:8]) + (f" and {len(updated) - 8} more" if len(updated) > 8 else "")
    return (
        f"lomo_kernels: raised during the update pass after {len(updated)} of {total} "
        f"parameters (and their optimizer state) were updated: {shown}. The model is now "
        "partly stepped (opt.last_step_partial_names lists them): reload a checkpoint (model "
        "and optimizer state_dict) to return to a consistent state"
    )


def computes_in_fp16(model: nn.Module) -> bool:
    """Whether a trainable parameter's forward and backward run in fp16 (loss scaling needed).

    Its dtype, or under FSDP2 the MixedPrecisionPolicy's param_dtype (fp32 shards computed
    in fp16 get fp16 gradients)."""
    model = unwrap_engine(model)
    return torch.float16 in compute_dtypes(model, trainable_parameters(model))


class _Claim:
    """Marks parameters as updated by one optimizer's hooks. A token of its own, so the
    registry below holds no reference to the optimizer."""

    def __init__(self, owner: str) -> None:
        self.owner = owner


# id(parameter) -> (the parameter, weakly; the claim of the optimizer whose hooks it has)
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], _Claim]] = {}


def updated_in_backward(t: Any) -> bool:
    """Whether `t` is a parameter that a live in-backward optimizer updates in its hooks."""
    entry = _OWNERS.get(id(t))
    return entry is not None and entry[0]() is t


def check_unowned(params: list[nn.Parameter], names: dict[int, str], new_owner: str) -> None:
    """Refuses parameters that a live in-backward optimizer already updates: both would
    update them in the same backward."""
    for p in params:
        if updated_in_backward(p):
            entry = _OWNERS[id(p)]
            raise ValueError(
                f"parameter {names.get(id(p), '?')!r} is already updated in backward by a live "
                f"{entry[1].owner}: call .detach() on that optimizer (or build it in a with "
                f"block) before building a {new_owner} on the same parameters"
            )


def _release(handles: list[Any], claim: _Claim, ids: list[int]) -> None:
    """Removes one optimizer's hooks and claims (its finalizer: no reference to it)."""
    for handle in handles:
        handle.remove()
    for i in ids:
        entry = _OWNERS.get(i)
        if entry is not None and entry[1] is claim:
            del _OWNERS[i]


def _grad_ready_hook(optimizer: weakref.ref[InBackwardOptimizer]) -> Any:
    """The post-accumulate-grad hook: a weak reference, so the model does not keep the
    optimizer alive (its finalizer removes the hooks when it is collected)."""

    def on_grad_ready(param: torch.Tensor) -> None:
        owner = optimizer()
        if owner is not None:
            owner._on_grad_ready(param)

    return on_grad_ready


class GroupHyperParameter:
    """An optimizer attribute that reads the first param group's value of `name` and, when
    assigned, checks the value and sets it in every group (lomo-optim keeps these as
    attributes; here they live in param_groups, where schedulers and state_dict see them)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, optimizer: Any, owner: type | None = None) -> Any:
        if optimizer is None:
            return self
        return optimizer.param_groups[0][self.name]

    def __set__(self, optimizer: Any, value: Any) -> None:
        value = CHECKS[self.name](value)
        for group in optimizer.param_groups:
            group[self.name] = value


class _AttachedAfterInit(abc.ABCMeta):
    """Attaches the hooks once the whole constructor, the subclass's included, succeeded:
    a constructor that fails leaves the model as it was."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().__call__(*args, **kwargs)
        optimizer._attach()
        return optimizer


class InBackwardOptimizer(torch.optim.Optimizer, metaclass=_AttachedAfterInit):
    """Base of Lomo/AdaLomo. Subclasses implement `_update(param, grad, group, scalars)`.

    The hooks stay until `detach()`, the end of a ``with`` block, or the optimizer's
    collection; then the model trains with plain backward and any other optimizer.
    """

    def __init__(
        self,
        model: nn.Module,
        defaults: dict[str, Any],
        *,
        backend: str | None,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        single_backward: bool = False,
        replicated: bool = True,
    ) -> None:
        """Validates the shared hyper-parameters in `defaults` (lr, weight_decay,
        clip_grad_norm, clip_grad_value) and the sharding set-up before any hook is attached.
        `bucket_numel`: gradient elements per reduce-scatter under ZeRO-3.
        `single_backward`: clip and check overflow within the update pass (single_pass.py).
        `replicated=False`: under torch.distributed, each rank's unsharded parameters are its
        own (pipeline stages, a model per rank), so no rank waits for another's gradients."""
        defaults = checked_group(defaults)
        model = unwrap_engine(model)
        params = trainable_parameters(model)
        check_unowned(params, parameter_names(model), type(self).__name__)
        self._sharding = sharding_for(
            params,
            parameter_names(model),
            model=model,
            bucket_numel=bucket_numel,
            replicated=bool(replicated),
        )
        super().__init__([{"params": params}], defaults)
        self.model = model
        self.backend = backend
        self._backend_name = requested_backend(backend)  # validated once, not per call
        self.step_count = 0
        self._phase = _IDLE
        self._norm_ready = False
        self._scalars: dict[torch.device, _DeviceScalars] = {}
        self._hook_groups = _for_hooks(self._checked_groups())
        # The step's clip threshold, read from the checked groups at each call: traced code
        # reads this float, not param_groups (whose lr changes every step: a guard on the
        # group would recompile a compiled step each time).
        self._max_norm: float | None = defaults["clip_grad_norm"]
        self._group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._index_of = {id(p): i for i, p in enumerate(params)}
        self._report: torch.Tensor | None = None
        self._report_event: Any = None
        self.last_grad_norm: torch.Tensor | None = None
        self._clip_coef: torch.Tensor | None = None  # of the last norm pass (lomo-optim's)
        self._norm_of_last_pass: torch.Tensor | None = None
        self._norm_graph: Any = None  # grad_fn of the loss of the last norm pass
        # The loss and max norm the last norm pass measured: its result serves that loss
        # only. A weak reference, so a collected loss whose id() is reused never matches.
        self._norm_loss: weakref.ref[torch.Tensor] | None = None
        self._norm_max_norm: float | None = None
        self.last_step_skipped = False
        self.last_step_partial = False
        # Whether the last step's backward raised, and which parameters it had updated by
        # then (see _record_interruption); the hooks append to _updated, resolved on error.
        self.last_step_interrupted = False
        self.last_step_partial_names: list[str] = []
        self._updated: list[torch.Tensor] = []
        self._embeddings = trained_embeddings(model)
        self.single_backward = bool(single_backward)
        self._single = SinglePassClip(None, params[0].device) if single_backward else None
        self._single_step = False  # this update pass clips and checks as gradients arrive
        self._reported_single = False  # the queued report is of a single-backward step
        # Keeps in-backward updates correct under compiled autograd.
        _compiled_autograd.install(updated_in_backward)
        self._release_hooks: weakref.finalize | None = None  # set by _attach

    # The hyper-parameters live in param_groups (as in torch.optim); these attributes are
    # lomo-optim's names for them (host values: reading them never syncs).
    lr = GroupHyperParameter("lr")
    weight_decay = GroupHyperParameter("weight_decay")
    clip_grad_norm = GroupHyperParameter("clip_grad_norm")
    clip_grad_value = GroupHyperParameter("clip_grad_value")

    @property
    def clip_coef(self) -> torch.Tensor | None:
        """lomo-optim's clip coefficient ``min(1, clip_grad_norm / (norm + 1e-6))`` of the
        last norm pass, a 0-d device tensor (``float()`` of it syncs); None before the first
        norm pass with clip_grad_norm set."""
        return self._clip_coef

    @property
    def grad_norms(self) -> torch.Tensor | list[Any]:
        """After a norm pass, a 1-D device tensor whose 2-norm is the global gradient norm
        (``torch.norm(opt.grad_norms)``, as with lomo-optim). lomo-optim holds one entry per
        gradient; here the norm pass sums squares into one device scalar, so it holds one
        entry, the global norm. ``[]`` before the first norm pass, as in lomo-optim."""
        return [] if self._norm_of_last_pass is None else self._norm_of_last_pass.reshape(1)

    # -- hooks' lifetime ----------------------------------------------------------------
    def _attach(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        hook = _grad_ready_hook(weakref.ref(self))
        claim, handles = _Claim(type(self).__name__), []
        try:
            for p in params:
                handles.append(p.register_post_accumulate_grad_hook(hook))
                _OWNERS[id(p)] = (weakref.ref(p), claim)
        except BaseException:
            _release(handles, claim, [id(p) for p in params])
            raise
        self._release_hooks = weakref.finalize(
            self, _release, handles, claim, [id(p) for p in params]
        )
        # What the hooks were built for, compared before each step (_check_parameters).
        self._layout = [(p, p.dtype, p.device) for p in params]

    def detach(self) -> None:
        """Removes every hook from the model: plain ``loss.backward()`` and any other
        optimizer work on it again. This optimizer can no longer step."""
        if self._release_hooks is not None:
            self._release_hooks()  # runs once; later calls do nothing

    def __enter__(self) -> InBackwardOptimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    @property
    def attached(self) -> bool:
        """Whether the hooks are on the model (False after `detach()`)."""
        return self._release_hooks is not None and self._release_hooks.alive

    # -- overridables -----------------------------------------------------------------
    def _host_hyper_parameters(self) -> dict[str, Any]:
        """Hyper-parameters kept outside param_groups, checked with them at every step."""
        return {}

    def _loss_scaler(self) -> DynamicLossScaler | None:
        return None

    def _static_inv_scale(self) -> float:
        return 1.0

    def _needs_detection_pass(self) -> bool:
        """Whether an inf/nan check must precede the update (fp16: make overflow atomic)."""
        return self._max_norm is not None

    def _update_measures(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """single_backward: whether `_update` measures this gradient's sum of squares and
        non-finite flag itself (it then takes ``on_grad_sumsq``, see `_update`)."""
        return False

    @abc.abstractmethod
    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        group: dict[str, Any],
        scalars: _DeviceScalars,
        skip_if: torch.Tensor,
    ) -> None:
        """Applies the step to one parameter; writes nothing when `skip_if` is non-zero.

        `group` holds the param group's hyper-parameters without "params" and "lr" (the lr
        is the device tensor `scalars.lr[group index]`). Where `_update_measures` is True
        (single_backward), it is called with `skip_if` None and a keyword ``on_grad_sumsq``,
        to be called with the gradient's [sum of squares, non-finite flag] before
        `scalars.clip_coef` is read (`ops.adalomo_update_`); it skips a non-finite gradient
        itself.
        """

    @abc.abstractmethod
    def _update_shards(
        self,
        ready: list[tuple[Shard, torch.Tensor]],
        scalars: _DeviceScalars,
        skip_if: torch.Tensor,
        clip_coefs: torch.Tensor | None = None,
        skips: torch.Tensor | None = None,
    ) -> None:
        """Applies the step to this rank's slices, given their reduced gradients.

        single_backward: `clip_coefs[i]` (clipping on) and `skips[i]` (1-element views) are
        entry i's coefficient and skip flag, in place of the step-wide ones."""

    def _after_norm_pass(self, found_inf: torch.Tensor) -> None:
        """Bookkeeping after a norm pass (an overflow lowers the loss scale at once)."""

    def _after_step(self, found_inf: torch.Tensor, detection: bool) -> None:
        """Bookkeeping after a completed step (loss scaler update); `detection`: a norm pass
        preceded it (and already applied an overflow it found)."""

    # -- hooks ------------------------------------------------------------------------
    def _scalars_for(self, device: torch.device) -> _DeviceScalars:
        scalars = self._scalars.get(device)
        if scalars is None:
            scalars = self._scalars[device] = _DeviceScalars(device)
        return scalars

    def _inv_scale_for(self, device: torch.device) -> torch.Tensor | None:
        """The gradients' inverse loss scale as the ops take it: a device tensor, or None
        for 1."""
        scaler = self._loss_scaler()
        if scaler is None:
            return optional_factor("inv_scale", self._static_inv_scale(), device)
        if scaler.device == device:
            return scaler.inv_scale
        return self._scalars[device].inv_scale

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None  # the gradient is dropped as soon as it has been used
        if self._phase == _IDLE:
            raise RuntimeError(GRAD_ACCUMULATION_ERROR)
        if grad is None:
            return
        if grad.layout != torch.strided:
            raise sparse_gradient_error(parameter_names(self.model).get(id(param), "?"))
        if self._sharding is not None:
            # Reduced to the owner rank first; `_consume_shards` gets this rank's slice.
            self._sharding.grad_ready(param, grad)
            return
        scalars = self._scalars_for(param.device)
        if self._phase == _NORM:
            self._accumulate_norm(grad, scalars)
            return
        self._note_updated(param)
        group = self._hook_groups[self._group_of[id(param)]]
        if not self._single_step:
            self._update(param, grad, group, scalars, self._skip_if(scalars))
        elif self._update_measures(param, grad):
            # Measured by the update's own first pass, the coefficient written into
            # scalars.clip_coef before the update reads it; a non-finite gradient skips the
            # tensor from within the update.
            measured = functools.partial(self._single.prepare_measured, clip_coef=scalars.clip_coef)
            self._update(param, grad, group, scalars, None, on_grad_sumsq=measured)
        else:
            skip_if = self._single.prepare(
                grad, self._inv_scale_for(param.device), self.backend, scalars.clip_coef
            )
            self._update(param, grad, group, scalars, skip_if)

    def _note_updated(self, param: torch.Tensor) -> None:
        # Noted before the update is launched: a failing update counts as applied. Traced
        # (compiled autograd), the append would replay only after the graph; not recorded.
        if not torch.compiler.is_compiling():
            self._updated.append(param)

    def _skip_if(self, scalars: _DeviceScalars) -> torch.Tensor:
        return scalars.norm_found_inf if self._norm_ready else scalars.no_skip

    def _accumulate_norm(self, grad: torch.Tensor, scalars: _DeviceScalars) -> None:
        ops.grad_sumsq_(
            grad,
            scalars.sumsq,
            inv_scale=self._inv_scale_for(grad.device),
            found_inf=scalars.norm_found_inf,
            backend=self.backend,
        )

    def _consume_shards(self, ready: list[tuple[Shard, torch.Tensor]]) -> None:
        """One reduce-scatter bucket's partitions, reduced: measure or update them."""
        if not ready:
            return
        scalars = self._scalars_for(ready[0][1].device)
        if self._phase == _NORM:
            for _, grad in ready:
                self._accumulate_norm(grad, scalars)
            return
        for shard, _ in ready:
            self._note_updated(shard.param)
        if self._single_step:
            # Every rank gets the same per-parameter norms and flags (one small all-reduce),
            # hence the same coefficients and skips (single_pass.py).
            coefs, skips = self._single.prepare_bucket(
                [grad for _, grad in ready],
                self._inv_scale_for(scalars.device),
                self.backend,
                self._sharding.all_reduce_sum_,
            )
            self._update_shards(ready, scalars, scalars.no_skip, clip_coefs=coefs, skips=skips)
        else:
            self._update_shards(ready, scalars, self._skip_if(scalars))

    # -- public API -------------------------------------------------------------------
    def grad_norm(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward pass that only measures: global grad norm and inf/nan, nothing updated.

        Keeps the graph (retain_graph=True) for the following `fused_backward(loss)`, except
        under ZeRO-3, where the update pass needs a forward of its own. Returns the total
        norm as a device tensor (no host sync).
        """
        self._begin_attempt()
        return self._norm_pass(loss)

    def _begin_attempt(self) -> None:
        """A user's norm pass starts a step attempt (lomo-optim's trainer skips the update
        pass after an overflow and tries again): its overflow counts anew."""

    def _norm_pass(self, loss: torch.Tensor) -> torch.Tensor:
        self._check_call(loss)
        self._report_previous_step()
        self._prepare_scalars()
        for scalars in self._scalars.values():
            scalars.sumsq.zero_()
            scalars.norm_found_inf.zero_()
        # Under sharding the update pass has its own forward (see ONE_LOSS_UNDER_SHARDING):
        # keeping this graph would only hold its activations through the next forward.
        retain = self._sharding is None or self._sharding.second_backward_ok
        self._run_backward(loss, _NORM, retain_graph=retain)
        total_sumsq = self._combine(lambda s: s.sumsq)
        found = self._combine(lambda s: s.norm_found_inf)
        if self._sharding is not None:
            # Partial sums of this rank's slices: one all-reduce gives every rank the total
            # and the same overflow decision.
            both = torch.cat([total_sumsq.reshape(1), found.reshape(1)])
            self._sharding.all_reduce_sum_(both)
            total_sumsq, found = both[:1], both[1:]
            self._norm_graph = loss.grad_fn
        self.last_grad_norm = self._norm_of_last_pass = total_sumsq.sqrt()
        if self._max_norm is not None:
            self._clip_coef = ops.clip_coef_from_sumsq(total_sumsq, self._max_norm).reshape(())
        for device, scalars in self._scalars.items():
            scalars.norm_found_inf.copy_(found.to(device, non_blocking=True))
            if self._max_norm is not None:
                scalars.clip_coef.copy_(self._clip_coef.to(device, non_blocking=True))
        self._after_norm_pass(found)
        self._remember_norm_of(loss)
        return self.last_grad_norm

    def fused_backward(self, loss: torch.Tensor, lr: float | None = None) -> None:
        """Backward with the update applied to each parameter as its gradient is ready.

        `lr` sets the learning rate of every param group (as lomo-optim does); omitted, the
        groups' own lr is used, so torch.optim.lr_scheduler schedulers work.
        """
        self._check_call(loss, lr)
        if self._sharding is not None and not self._sharding.second_backward_ok:
            self._check_sharded_pattern(loss)
        self._keep_norm_only_for(loss)
        single = self._single is not None and not self._norm_ready and self._needs_detection_pass()
        if not self._norm_ready and self._needs_detection_pass() and not single:
            self._norm_pass(loss)  # same attempt as a grad_norm of another loss
        else:
            self._report_previous_step()
            self._prepare_scalars()
        if not self._norm_ready:
            self._refuse_sparse_graph(loss)  # no norm pass would meet the sparse gradient first
        if single:
            self._single.max_norm = self._max_norm
            self._single.begin_step()
        self._single_step = single
        try:
            self._run_backward(loss, _UPDATE, retain_graph=False)
        finally:
            detection = self._norm_ready
            self._forget_norm()
            self._single_step = False
        self._finish_step(detection, single)

    # Which loss the last norm pass measured: host bookkeeping, kept out of a compiled step
    # (a traced weakref would break the graph, and its guards would recompile the next step).
    @torch.compiler.disable
    def _remember_norm_of(self, loss: torch.Tensor) -> None:
        self._norm_ready = True
        self._norm_loss = weakref.ref(loss)
        self._norm_max_norm = self._max_norm

    @torch.compiler.disable
    def _refuse_sparse_graph(self, loss: torch.Tensor) -> None:
        if sparse_embedding_in_graph(loss):
            raise ValueError(
                "the loss's backward holds an embedding lookup with sparse=True "
                "(F.embedding(..., sparse=True)); LOMO updates dense parameters in place and "
                "nothing was updated: pass sparse=False"
            )

    @torch.compiler.disable
    def _keep_norm_only_for(self, loss: torch.Tensor) -> None:
        self._norm_ready = self._norm_ready and self._norm_is_for(loss)

    @torch.compiler.disable
    def _forget_norm(self) -> None:
        self._norm_ready = False
        self._norm_loss = None

    # Host-side bookkeeping runs eagerly even inside a compiled training step: traced, it
    # would specialise on the float lr and the step count and recompile every step. Only
    # these helpers are excluded, not the backward: compiled autograd stays on for it.
    @torch.compiler.disable
    def _check_call(self, loss: torch.Tensor, lr: float | None = None) -> None:
        """Checks everything the step reads on the host, before anything changes, then sets
        every group's lr to `lr` when given (as lomo-optim does)."""
        self._check_loss(loss)
        self._check_parameters()
        _compiled_autograd.check_supported()
        groups = self._checked_groups(None if lr is None else check_lr(lr))
        checked_group(self._host_hyper_parameters(), type(self).__name__)
        if lr is not None:
            for group in self.param_groups:
                group["lr"] = float(lr)
        self._hook_groups = _for_hooks(groups)
        self._max_norm = groups[0]["clip_grad_norm"]
        self.last_step_interrupted = False
        self.last_step_partial_names = []

    def _checked_groups(self, lr: float | None = None) -> list[dict[str, Any]]:
        return checked_groups(self.param_groups, "param_groups", lr)

    @torch.compiler.disable
    def _finish_step(self, detection: bool, single: bool) -> None:
        if single:
            found = self._single.end_step()
            self.last_grad_norm = self._single.last_norm()
        else:
            found = self._combine(lambda s: s.norm_found_inf if detection else s.update_found_inf)
        if self._sharding is not None:
            if not detection and not single:  # every rank reports the same step outcome
                self._sharding.all_reduce_sum_(found)
            self._sharding.after_update()
        self._after_step(found, detection)
        self._queue_report(found, atomic=detection)
        self._reported_single = single
        self.step_count += 1
        self._opt_called = True  # lets lr schedulers know the step happened

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """No-op: the update already happened inside `fused_backward`.

        Kept so frameworks that call `optimizer.step()` keep working. A closure is called
        (under grad) and its loss returned, but it updates nothing by itself.
        """
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    # -- helpers ----------------------------------------------------------------------
    def _check_loss(self, loss: torch.Tensor) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("the loss must be a scalar tensor")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad: nothing to back-propagate")

    def _check_parameters(self) -> None:
        """Refuses a step when the model's parameters changed since construction: hooks and
        state were built for the trainable parameters, their dtype, device and layout then.

        Without sharding the model is walked (parameters unfrozen or replaced); FSDP2 and
        ZeRO-3 swap the registered tensors themselves, so there only freezing is checked.
        """
        if not self.attached:
            raise RuntimeError(
                f"this {type(self).__name__} was detached (detach() or the end of its with "
                "block): its hooks are gone; build a new optimizer to train with it"
            )
        problem = None
        for p, dtype, device in self._layout:
            if not p.requires_grad:
                problem = (p, "was frozen (requires_grad=False)")
            elif self._sharding is None and (p.dtype != dtype or p.device != device):
                problem = (p, f"was {dtype} on {device} and is now {p.dtype} on {p.device}")
            elif self._sharding is None and not p.is_contiguous():
                problem = (p, "is no longer contiguous (its .data was replaced)")
            if problem:
                break
        if problem is None and self._sharding is None:
            hooked = {id(p) for p, _, _ in self._layout}
            current = {id(p) for p in self.model.parameters() if p.requires_grad}
            if current != hooked:
                added = next(iter(current - hooked), None)
                problem = (
                    added,
                    "is trainable but has no hook (unfrozen or replaced)"
                    if added is not None
                    else "is no longer in the model (replaced)",
                )
        if problem is not None:
            self._refuse_changed(*problem)
        refuse_sparse_embeddings(self._embeddings)

    def _refuse_changed(self, param: torch.Tensor | None, what: str) -> None:
        names = parameter_names(self.model)
        if param is None:
            gone = {id(p) for p, _, _ in self._layout} - set(names)
            param = next(p for p, _, _ in self._layout if id(p) in gone)
        raise RuntimeError(
            f"parameter {names.get(id(param), '?')!r} {what} since the {type(self).__name__} "
            "was built, so its hooks and state no longer match the model: call opt.detach() "
            "and build a new optimizer (load its state_dict() to keep the step count)"
        )

    def _norm_is_for(self, loss: torch.Tensor) -> bool:
        """Whether the last norm pass measured `loss` with the current clip_grad_norm."""
        if self._norm_max_norm != self._max_norm:
            return False
        if self._sharding is not None and not self._sharding.second_backward_ok:
            return True  # ZeRO-3: the norm pass had a forward of its own (same batch)
        return self._norm_loss is not None and self._norm_loss() is loss

    def _check_sharded_pattern(self, loss: torch.Tensor) -> None:
        """Refuses, before any change, a second backward over a ZeRO-3 loss's graph."""
        same_graph = self._norm_ready and loss.grad_fn is self._norm_graph
        missing_norm = (
            not self._norm_ready and self._needs_detection_pass() and self._single is None
        )
        if same_graph or missing_norm:
            self._norm_ready = False
            self._norm_graph = None
            what = (
                "fused_backward got the loss grad_norm already back-propagated"
                if same_graph
                else "this step needs a norm pass (clip_grad_norm or fp16) before the update"
            )
            raise RuntimeError(f"{what}; {ONE_LOSS_UNDER_SHARDING}")

    @torch.compiler.disable  # see _check_call
    def _prepare_scalars(self) -> None:
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                scalars = self._scalars_for(p.device)
                lr_t = scalars.lr.get(group_index)
                if lr_t is None:
                    lr_t = scalars.lr[group_index] = torch.zeros(1, device=p.device)
                if p.grad is not None:
                    p.grad = None  # stale gradients would be summed into this step's
        for group_index, group in enumerate(self.param_groups):
            for scalars in self._scalars.values():
                if group_index in scalars.lr:
                    scalars.lr[group_index].fill_(group["lr"])
        scaler = self._loss_scaler()
        for scalars in self._scalars.values():
            scalars.update_found_inf.zero_()
            if scaler is not None and scalars.device != scaler.device:
                # One copy per device and step, not one per parameter in the hooks.
                scalars.inv_scale.copy_(scaler.inv_scale, non_blocking=True)

    def _run_backward(self, loss: torch.Tensor, phase: str, retain_graph: bool) -> None:
        scaler = self._loss_scaler()
        if scaler is not None:
            loss = loss * scaler.scale.to(loss.device, non_blocking=True).reshape(())
        elif self._static_inv_scale() != 1.0:
            loss = loss / self._static_inv_scale()
        self._phase = phase
        self._updated.clear()
        tracked = not _compiled_autograd.compiled_autograd_active()
        sharding = self._sharding
        try:
            if sharding is not None:
                sharding.begin(self._consume_shards)
            loss.backward(retain_graph=retain_graph)
            if sharding is not None:
                sharding.finish()  # the last buckets: reduced and consumed before returning
        except BaseException as error:
            if sharding is not None:
                sharding.abandon()
            # Compilation fails before the graph runs: no parameter has been written.
            if (
                phase == _UPDATE
                and isinstance(error, Exception)
                and _compiled_autograd.is_aliased_input_failure(error)
            ):
                raise RuntimeError(
                    _compiled_autograd.EAGER_FORWARD_MESSAGE.format(version=torch.__version__)
                ) from error
            if phase == _UPDATE:
                self._record_interruption(error, tracked)
            raise
        finally:
            self._phase = _IDLE
            self._updated.clear()

    def _record_interruption(self, error: BaseException, tracked: bool) -> None:
        """Reports which parameters an interrupted update pass had already updated (a norm
        pass writes no parameter or state: its interruption changes nothing)."""
        names = parameter_names(self.model)
        self.last_step_interrupted = True
        self.last_step_partial_names = [names.get(id(p), "?") for p in self._updated]
        total = sum(len(g["params"]) for g in self.param_groups)
        error.add_note(interruption_note(self.last_step_partial_names, total, tracked))

    def _combine(self, pick: Any) -> torch.Tensor:
        """Sum of one per-device scalar over devices, on the first device."""
        values = [pick(s) for s in self._scalars.values()]
        total = values[0].clone()
        for v in values[1:]:
            total += v.to(total.device, non_blocking=True)
        return total

    def _queue_report(self, found: torch.Tensor, atomic: bool) -> None:
        """Copies the step's overflow flags to the host without waiting for them."""
        scaler = self._loss_scaler()
        at_min = scaler.overflow_at_min if scaler is not None else torch.zeros_like(found)
        flags = torch.cat(
            [
                found.reshape(1),
                at_min.to(found.device).reshape(1),
                torch.full_like(found.reshape(1), float(atomic)),
            ]
        )
        if flags.device.type == "cuda":
            if self._report is None:
                self._report = torch.empty(3, pin_memory=True)
            self._report.copy_(flags, non_blocking=True)
            self._report_event = torch.cuda.Event()
            self._report_event.record()
        else:
            self._report = flags
            self._report_event = None

    @torch.compiler.disable  # see _check_call
    def _report_previous_step(self) -> None:
        """Reads the last step's overflow flags (long finished) and reports them."""
        if self._report is None:
            return
        if self._report_event is not None:
            self._report_event.synchronize()
        found, at_min, atomic = (float(x) for x in self._report.numpy())
        self._report = None
        self.last_step_skipped = bool(found) and bool(atomic)
        self.last_step_partial = bool(found) and not atomic
        if (
            at_min
            and self._loss_scaler() is not None
            and self._loss_scaler().raise_error_at_min_scale
        ):
            raise FloatingPointError(
                "Current loss scale already at minimum - cannot decrease scale anymore. "
                "The gradients overflow even unscaled: lower the learning rate or check the "
                "data; pass loss_scale_args={'raise_error_at_min_scale': False} to go on."
            )
        if found and not atomic and self._reported_single:
            scale = ", the loss scale was lowered" if self._loss_scaler() is not None else ""
            warnings.warn(
                PARTIAL_STEP_WARNING.format(
                    step=self.step_count - 1, count=int(found), scale=scale
                ),
                RuntimeWarning,
                stacklevel=3,
            )
        elif found and not atomic:
            warnings.warn(
                f"step {self.step_count - 1}: inf/nan gradient elements were found during the "
                "update; those elements were left unchanged, the rest of the step was applied. "
                "Set clip_grad_norm (or use fp16 loss scaling) to check before updating, "
                "which makes an overflowing step change nothing.",
                RuntimeWarning,
                stacklevel=3,
            )

    def flush_report(self) -> None:
        """Reports the last step's overflow now (at the end of training, for example)."""
        self._report_previous_step()

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        scaler = self._loss_scaler()
        state["lomo"] = {
            "optimizer": self._state_format(),
            "step_count": self.step_count,
            "loss_scaler": None if scaler is None else scaler.state_dict(),
        }
        if self._single is not None:
            state["lomo"]["single_backward"] = self._single.state_dict()
        return state

    def consolidated_state_dict(self) -> dict[str, Any]:
        """`state_dict()` with sharded state gathered whole, on every rank (a collective).

        Loads into the same optimizer built on the unsharded model in one process. Without
        sharding it is `state_dict()`.
        """
        state = self.state_dict()
        if self._sharding is None:
            return state
        params = [p for g in self.param_groups for p in g["params"]]
        for index, values in state["state"].items():
            state["state"][index] = self._full_state(params[index], values)
        return state

    def _full_state(self, param: nn.Parameter, values: dict[str, Any]) -> dict[str, Any]:
        """One parameter's state, unsharded (subclasses with sliced state gather it)."""
        return values

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads `state_dict` after checking the whole of it: a checkpoint of another
        optimizer class, model or sharding, or with non-finite values, is refused with
        nothing applied."""
        writer = lomo_optim_writer(state_dict)
        if writer is not None:
            state_dict = self._from_lomo_optim(state_dict, writer)
        self._check_state_dict(state_dict)
        state_dict = dict(state_dict)
        extra = state_dict.pop("lomo", None)
        self._load_torch_state(state_dict)
        self._norm_ready = False  # a norm measured before the load belongs to the old state
        self._norm_loss = None
        if extra is not None:
            self.step_count = int(extra["step_count"])
            self._load_scaler_state(extra["loss_scaler"])
            if self._single is not None and "single_backward" in extra:
                self._single.load_state_dict(extra["single_backward"])
        if writer is not None:
            self._after_lomo_optim_load()

    def _after_lomo_optim_load(self) -> None:
        """Called once a lomo-optim state_dict was loaded (AdaLomo says what it lacked)."""

    def _from_lomo_optim(self, state_dict: dict[str, Any], writer: str) -> dict[str, Any]:
        """This optimizer's own state_dict with the hyper-parameters of a lomo-optim one.

        lomo-optim's state_dict holds only its constructor's hyper-parameters (lomo-optim
        itself never reads them back); what it lacks (AdaLomo's moments and step count,
        the loss scaler) stays as it is here. Its ``weight_decay <= 0`` means off, as here 0.
        """
        own = self._state_format()
        if writer != own:
            raise ValueError(
                f"this state_dict was written by lomo_optim.{writer}; {own} keeps other "
                f"hyper-parameters: load it into lomo_kernels.{writer}, or start {own} from its "
                "fresh state"
            )
        saved = state_dict["param_groups"][0]
        # lomo-optim lists every parameter of the model, frozen ones included.
        count = len(list(self.model.parameters()))
        if len(self.param_groups) != 1 or len(saved["params"]) != count:
            raise ValueError(
                f"this lomo_optim.{writer} state_dict lists {len(saved['params'])} parameters, "
                f"this model has {count}: the checkpoint belongs to another model"
            )
        hyper = {k: v for k, v in saved.items() if k != "params"}
        if "weight_decay" in hyper and _is_number(hyper["weight_decay"]):
            hyper["weight_decay"] = max(hyper["weight_decay"], 0.0)
        current = self.state_dict()
        group = current["param_groups"][0]
        return {**current, "param_groups": [{**group, **hyper, "params": group["params"]}]}

    def _load_torch_state(self, state_dict: dict[str, Any]) -> None:
        """Applies torch.optim's part (param_groups, per-parameter state), already checked."""
        super().load_state_dict(state_dict)

    @classmethod
    def _state_format(cls) -> str:
        """The optimizer whose state this class keeps: Lomo or AdaLomo (subclasses too)."""
        return cls.__mro__[cls.__mro__.index(InBackwardOptimizer) - 1].__name__

    def _check_state_dict(self, state_dict: Any) -> None:
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError(
                "load_state_dict takes an optimizer state_dict: a dict with 'state' and "
                "'param_groups' (from optimizer.state_dict())"
            )
        extra = state_dict.get("lomo")
        if extra is not None and not isinstance(extra, dict):
            raise ValueError("state_dict['lomo'] must be a dict (from optimizer.state_dict())")
        own = self._state_format()
        writer = (extra or {}).get("optimizer", own)
        if writer != own:
            raise ValueError(
                f"this state_dict was written by {writer}; {own} keeps other state and "
                f"hyper-parameters: load it into a {writer}, or start {own} from its fresh state"
            )
        self._check_saved_groups(state_dict["param_groups"])
        self._check_saved_states(state_dict["state"])
        if extra is not None:
            self._check_saved_extra(extra)

    def _check_saved_groups(self, groups: Any) -> None:
        own = self.param_groups
        if not isinstance(groups, list) or len(groups) != len(own):
            count = len(groups) if isinstance(groups, list) else "no list of"
            raise ValueError(
                f"state_dict has {count} param groups, this optimizer {len(own)}: the "
                "checkpoint belongs to another optimizer set-up"
            )
        for i, (saved, group) in enumerate(zip(groups, own, strict=True)):
            saved_params = saved.get("params", ()) if isinstance(saved, dict) else ()
            if len(saved_params) != len(group["params"]):
                raise ValueError(
                    f"state_dict['param_groups'][{i}] holds {len(saved_params)} parameters, this "
                    f"optimizer's {len(group['params'])}: the checkpoint belongs to another model "
                    "(or to other frozen parameters)"
                )
            differing = {k for k in group if k in CHECKS} ^ {k for k in saved if k in CHECKS}
            if differing:
                raise ValueError(
                    f"state_dict['param_groups'][{i}] differs from this optimizer's in the "
                    f"hyper-parameters {sorted(differing)}: it was written by another optimizer "
                    "class"
                )
        checked_groups(groups, "state_dict['param_groups']")

    def _check_saved_states(self, states: Any) -> None:
        """Per-parameter state: the same indices, keys and shapes as this optimizer's own
        (Lomo keeps none), finite values (see `_check_state_values`)."""
        params = [p for g in self.param_groups for p in g["params"]]
        names = parameter_names(self.model)
        if not isinstance(states, dict):
            raise ValueError("state_dict['state'] must be a dict of parameter index -> state")
        expected = {i for i, p in enumerate(params) if self.state.get(p)}
        unknown = set(states) - expected
        if unknown:
            raise ValueError(
                f"state_dict['state'] holds state for parameter indices {sorted(unknown)[:8]}, "
                f"for which {type(self).__name__} keeps none: the checkpoint belongs to another "
                "optimizer class or model"
            )
        for index in sorted(expected):
            param = params[index]
            where = f"state_dict['state'][{index}] (parameter {names.get(id(param), '?')!r})"
            if index not in states:
                raise ValueError(f"{where} is missing: the checkpoint belongs to another model")
            self._check_saved_state(where, states[index], self.state[param])

    def _check_saved_state(self, where: str, saved: Any, own: dict[str, Any]) -> None:
        if not isinstance(saved, dict) or set(saved) != set(own):
            keys = sorted(saved) if isinstance(saved, dict) else saved
            raise ValueError(f"{where} has the keys {keys}, this optimizer's {sorted(own)}")
        for key, value in own.items():
            if not isinstance(value, torch.Tensor):
                continue
            incoming = saved[key]
            if not isinstance(incoming, torch.Tensor) or incoming.shape != value.shape:
                shape = tuple(incoming.shape) if isinstance(incoming, torch.Tensor) else incoming
                raise ValueError(
                    f"{where}[{key!r}] has shape {shape}, this optimizer's "
                    f"{tuple(value.shape)}: the checkpoint belongs to another model or "
                    "sharding (consolidated_state_dict() loads into the unsharded model)"
                )
            problem = self._check_state_values(incoming)
            if problem:
                raise ValueError(f"{where}[{key!r}] {problem}: the checkpoint is corrupt")

    def _check_state_values(self, values: torch.Tensor) -> str | None:
        """What is wrong with a saved state tensor's values, or None."""
        if not bool(torch.isfinite(values).all()):
            return "holds inf/nan"
        return None

    def _check_saved_extra(self, extra: dict[str, Any]) -> None:
        step = extra.get("step_count")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"state_dict['lomo']['step_count'] must be an int >= 0, got {step!r}")
        if extra.get("loss_scaler") is not None:
            check_scaler_state(extra["loss_scaler"], "state_dict['lomo']['loss_scaler']")
        if extra.get("single_backward") is not None:
            SinglePassClip.check_state_dict(extra["single_backward"])

    def _load_scaler_state(self, state: dict[str, Any] | None) -> None:
        """Subclasses with a loss scaler restore it here."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def split_loss_scale_args(args: dict[str, Any]) -> dict[str, Any]:
    unknown = set(args) - set(LOSS_SCALE_KEYS) - {"dtype"}
    if unknown:
        raise ValueError(
            f"unknown loss_scale_args {sorted(unknown)}; accepted: {', '.join(LOSS_SCALE_KEYS)}"
        )
    return {k: v for k, v in args.items() if k != "dtype"}
