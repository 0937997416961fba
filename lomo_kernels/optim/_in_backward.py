"""The in-backward optimizer's hook state machine, shared by Lomo and AdaLomo.

Each trainable parameter gets one post-accumulate-grad hook (`hooks.py`). During
`fused_backward` the hook updates that parameter with a fused op and frees its gradient;
during `grad_norm` it only accumulates the gradient's squared norm and inf/nan flag on the
device. Which pass runs and how the update pass treats a gradient is the step mode
(`step_mode.py`). Flags, norms, clip coefficients, the loss scale and the learning rate stay
in device tensors, so backward never waits for the host.

The other jobs live beside it: checks before any change (`validation.py`, `_hyper.py`), the
param groups (`param_groups.py`), routing to a sharding (`sharded_steps.py`), step reports
(`reporting.py`), checkpoints (`checkpoint.py`) and parameters a fused op hands over in
blocks of rows instead of a gradient (`row_blocks.py`).
"""

from __future__ import annotations

import abc
import functools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import compile as _compiled_autograd
from .. import ops
from ..core.scalars import copied_to, optional_factor
from ..distributed import DEFAULT_BUCKET_NUMEL, sharding_for, unwrap_engine
from ..ops.backends import requested_backend
from ._hyper import CHECKS, check_lr, checked_group, checked_groups
from .checkpoint import CheckpointState
from .head_guard import refuse_bypassed_head
from .hooks import AttachedAfterInit, attach_hooks, check_unowned, updated_in_backward
from .loss_scaler import DynamicLossScaler
from .param_groups import (
    GroupHyperParameter,
    build_param_groups,
    current_group_index,
    group_index,
    hook_groups,
)
from .reporting import StepReporting
from .rounding import WriteBackRounding
from .row_blocks import RowBlockSteps
from .sharded_steps import ShardedSteps
from .single_backward import SingleBackwardClip
from .step_mode import Phase, StepMode
from .validation import (
    ParameterLayout,
    check_loss,
    parameter_names,
    refuse_graph,
    sparse_gradient_error,
    trainable_parameters,
)

GRAD_ACCUMULATION_ERROR = (
    "LOMO updates each parameter inside backward and frees its gradient at once, so "
    "gradients cannot be accumulated over micro-batches: use a larger batch instead (with "
    "activation checkpointing if memory is short)."
)


def plain_backward_error() -> str:
    """The refusal of a backward that reached a hook outside `fused_backward`/`grad_norm`,
    worded for where the caller is: whether `enable_transformers()` is active."""
    head = (
        "a backward reached the hook of a parameter that a Lomo/AdaLomo updates, outside "
        "opt.fused_backward(loss) and opt.grad_norm(loss) (a plain loss.backward(), or "
        "gradient accumulation); nothing was updated. " + GRAD_ACCUMULATION_ERROR
    )
    integration = sys.modules.get("lomo_kernels.integrations.huggingface")
    if integration is not None and integration.transformers_enabled():
        return (
            f"{head} lomo_kernels.enable_transformers() is active, so transformers' Trainer "
            "and accelerator.backward(loss) already run opt.fused_backward: this backward came "
            "from elsewhere (your own loss.backward(), or a library calling it directly); "
            "call opt.fused_backward(loss) there instead, once per step."
        )
    return (
        f"{head} Call opt.fused_backward(loss) instead of loss.backward(), once per step. "
        "With transformers' Trainer (TRL's trainers too) or accelerate, call "
        "lomo_kernels.enable_transformers() first (TRL: lomo_kernels.enable_trl()), or use "
        "lomo_kernels.integrations.hf_trainer.LomoTrainer."
    )


DONATED_BUFFERS_ERROR = (
    "grad_norm(loss) keeps the loss's graph for the update pass, but this graph's compiled "
    "backward reuses the buffers it saved (torch's donated buffers), so torch runs it only "
    "once. Use single_backward=True (one backward per step, no norm pass), or set "
    "torch._functorch.config.donated_buffer = False before the first compiled forward. No "
    "parameter was changed."
)


def _donates_saved_buffers(error: RuntimeError) -> bool:
    """Whether `error` is torch's refusal to keep the graph of a compiled backward that
    reuses its saved buffers (raised before that backward runs)."""
    return "donated buffer" in str(error)


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
    # Per trainable parameter (by index), this device's part of the norm pass's sums of
    # squares; None where the pass runs under compiled autograd (see `_norm_pass`).
    param_sumsq: torch.Tensor | None = None

    def __post_init__(self) -> None:
        def zeros() -> torch.Tensor:
            return torch.zeros(1, device=self.device)

        self.sumsq, self.norm_found_inf, self.update_found_inf = zeros(), zeros(), zeros()
        self.no_skip, self.clip_coef = zeros(), torch.ones(1, device=self.device)
        self.inv_scale = torch.ones(1, device=self.device)


class InBackwardOptimizer(
    StepReporting, ShardedSteps, CheckpointState, RowBlockSteps, metaclass=AttachedAfterInit
):
    """Base of Lomo/AdaLomo. Subclasses implement `_update(param, grad, group, scalars)`
    and `_update_shards` (sharded slices).

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
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        rounding: WriteBackRounding | None = None,
    ) -> None:
        """Validates the shared hyper-parameters in `defaults` (lr, weight_decay,
        clip_grad_norm, clip_grad_value) and the sharding set-up before any hook is attached.
        `bucket_numel`: gradient elements per reduce-scatter under ZeRO-3.
        `single_backward`: clip and check overflow within the update pass
        (single_backward.py).
        `replicated=False`: under torch.distributed, each rank's unsharded parameters are its
        own (pipeline stages, a model per rank), so no rank waits for another's gradients.
        `param_groups`: torch-style groups of the model's parameters (param_groups.py).
        `rounding`: the write-back's rounding (rounding.py; None: to nearest)."""
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
        super().__init__(build_param_groups(model, params, param_groups, defaults), defaults)
        self.model = model
        self.rounding = WriteBackRounding(False, 0) if rounding is None else rounding
        self.backend = backend
        self._backend_name = requested_backend(backend)  # validated once, not per call
        self.step_count = 0
        self._mode = StepMode()
        self._scalars: dict[torch.device, _DeviceScalars] = {}
        self._hook_groups = hook_groups(self._checked_groups())
        # The step's clip threshold, read from the checked groups at each call: traced code
        # reads this float, not param_groups (whose lr changes every step: a guard on the
        # group would recompile a compiled step each time).
        self._max_norm: float | None = defaults["clip_grad_norm"]
        self._group_of = group_index(self.param_groups)
        self._index_of = {id(p): i for i, p in enumerate(params)}
        self.last_grad_norm: torch.Tensor | None = None
        self._clip_coef: torch.Tensor | None = None  # of the last norm pass (lomo-optim's)
        self._norm_of_last_pass: torch.Tensor | None = None
        self._param_norms: torch.Tensor | None = None  # of the last eager norm pass
        self._init_reporting()
        self._init_row_blocks()
        self._layout = ParameterLayout(model, params, sharded=self._sharding is not None)
        self.single_backward = bool(single_backward)
        self._single_backward_clip = (
            SingleBackwardClip(None, params[0].device) if single_backward else None
        )
        # Keeps in-backward updates correct under compiled autograd.
        _compiled_autograd.install(updated_in_backward)
        self._release_hooks: Any = None  # set by _attach

    # The hyper-parameters live in param_groups (as in torch.optim); these attributes are
    # lomo-optim's names for them (host values: reading them never syncs).
    lr = GroupHyperParameter("lr")
    weight_decay = GroupHyperParameter("weight_decay")
    clip_grad_norm = GroupHyperParameter("clip_grad_norm")
    clip_grad_value = GroupHyperParameter("clip_grad_value")

    @property
    def stochastic_rounding(self) -> bool:
        """Whether bf16 and fp16 parameters are written back with stochastic rounding."""
        return self.rounding.stochastic

    @property
    def seed(self) -> int:
        """The stochastic rounding's seed."""
        return self.rounding.seed

    @property
    def clip_coef(self) -> torch.Tensor | None:
        """lomo-optim's clip coefficient ``min(1, clip_grad_norm / (norm + 1e-6))`` of the
        last norm pass, a 0-d device tensor (``float()`` of it syncs); None before the first
        norm pass with clip_grad_norm set."""
        return self._clip_coef

    @property
    def grad_norms(self) -> torch.Tensor | list[Any]:
        """lomo-optim's per-gradient norms of the last norm pass: a 1-D device tensor with one
        entry per trainable parameter (in model order; 0 for one that got no gradient, which
        lomo-optim leaves out), whose 2-norm is the global norm (``torch.norm(opt.grad_norms)``,
        as with lomo-optim). Sharded: each whole parameter's norm, on every rank. After a norm
        pass under compiled autograd it holds one entry, the global norm (that pass sums into
        one device scalar). ``[]`` before the first norm pass, as in lomo-optim."""
        if self._norm_of_last_pass is None:
            return []
        return (
            self._norm_of_last_pass.reshape(1) if self._param_norms is None else self._param_norms
        )

    # -- hooks' lifetime ----------------------------------------------------------------
    def _attach(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        self._release_hooks = attach_hooks(self, params)

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
        if self._mode.phase is Phase.IDLE:
            raise RuntimeError(plain_backward_error())
        if grad is None:
            return
        self._note_whole_gradient(param)
        if grad.layout != torch.strided:
            raise sparse_gradient_error(parameter_names(self.model).get(id(param), "?"))
        if self._sharding is not None:
            self._route_to_sharding(param, grad)  # reduced first, then stepped as slices
            return
        scalars = self._scalars_for(param.device)
        if self._mode.phase is Phase.NORM:
            self._accumulate_norm(param, grad, scalars)
            return
        self._note_updated(param)
        group = self._hook_groups[self._group_of[id(param)]]
        if not self._mode.single_backward:
            self._update(param, grad, group, scalars, self._skip_if(scalars))
        elif self._update_measures(param, grad):
            # Measured by the update's own first pass, the coefficient written into
            # scalars.clip_coef before the update reads it; a non-finite gradient skips the
            # tensor from within the update.
            measured = functools.partial(
                self._single_backward_clip.prepare_measured, clip_coef=scalars.clip_coef
            )
            self._update(param, grad, group, scalars, None, on_grad_sumsq=measured)
        else:
            skip_if = self._single_backward_clip.prepare(
                grad, self._inv_scale_for(param.device), self.backend, scalars.clip_coef
            )
            self._update(param, grad, group, scalars, skip_if)

    def _skip_if(self, scalars: _DeviceScalars) -> torch.Tensor:
        return scalars.norm_found_inf if self._mode.norm_ready else scalars.no_skip

    def _accumulate_norm(
        self, param: torch.Tensor, grad: torch.Tensor, scalars: _DeviceScalars
    ) -> None:
        # Into the parameter's own slot, then added to the total: the total's rounding is
        # that of summing into it directly (the slot starts at 0).
        slots = scalars.param_sumsq
        target = scalars.sumsq
        if slots is not None:
            index = self._index_of[id(param)]
            target = slots[index : index + 1]
        ops.grad_sumsq_(
            grad,
            target,
            inv_scale=self._inv_scale_for(grad.device),
            found_inf=scalars.norm_found_inf,
            backend=self.backend,
        )
        if slots is not None:
            scalars.sumsq.add_(target)

    # -- public API -------------------------------------------------------------------
    def grad_norm(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward pass that only measures: global grad norm and inf/nan, nothing updated.

        Keeps the graph (retain_graph=True) for the following `fused_backward(loss)`, except
        under ZeRO-3, where the update pass needs a forward of its own. Returns the total
        norm as a device tensor (no host sync).
        """
        self._refuse_bypassed_head(loss)
        self._begin_attempt()
        return self._norm_pass(loss)

    def _begin_attempt(self) -> None:
        """A user's norm pass starts a step attempt (lomo-optim's trainer skips the update
        pass after an overflow and tries again): its overflow counts anew."""

    def _norm_pass(self, loss: torch.Tensor) -> torch.Tensor:
        self._check_call(loss)
        self._report_previous_step()
        self._prepare_scalars()
        # Per-parameter sums (grad_norms) in eager backward; a compiled backward keeps the
        # one running sum (a slot per parameter would be one more graph input each).
        per_parameter = not (
            torch.compiler.is_compiling() or _compiled_autograd.compiled_autograd_active()
        )
        for scalars in self._scalars.values():
            scalars.sumsq.zero_()
            scalars.norm_found_inf.zero_()
            scalars.param_sumsq = (
                torch.zeros(len(self._index_of), device=scalars.device) if per_parameter else None
            )
        # Under ZeRO-3 the update pass has its own forward (see ONE_LOSS_UNDER_SHARDING):
        # keeping this graph would only hold its activations through the next forward.
        retain = not self._one_loss_per_pass
        try:
            self._run_backward(loss, Phase.NORM, retain_graph=retain)
        except RuntimeError as error:
            if retain and _donates_saved_buffers(error):
                raise RuntimeError(DONATED_BUFFERS_ERROR) from error
            raise
        total_sumsq = self._combine(lambda s: s.sumsq)
        found = self._combine(lambda s: s.norm_found_inf)
        param_sumsq = self._combine(lambda s: s.param_sumsq) if per_parameter else None
        if self._sharding is not None:
            # Partial sums of this rank's slices: one all-reduce gives every rank the total
            # (and each parameter's) and the same overflow decision.
            parts = [total_sumsq.reshape(1), found.reshape(1)]
            both = torch.cat(parts if param_sumsq is None else [*parts, param_sumsq])
            self._sharding.all_reduce_sum_(both)
            total_sumsq, found = both[:1], both[1:2]
            param_sumsq = None if param_sumsq is None else both[2:]
        self._param_norms = None if param_sumsq is None else param_sumsq.sqrt()
        self.last_grad_norm = self._norm_of_last_pass = total_sumsq.sqrt()
        if self._max_norm is not None:
            self._clip_coef = ops.clip_coef_from_sumsq(total_sumsq, self._max_norm).reshape(())
        for device, scalars in self._scalars.items():
            scalars.norm_found_inf.copy_(copied_to(found, device))
            if self._max_norm is not None:
                scalars.clip_coef.copy_(copied_to(self._clip_coef, device))
        self._after_norm_pass(found)
        self._mode.norm_measured(loss, self._max_norm, keep_graph=self._sharding is not None)
        return self.last_grad_norm

    @torch.compiler.disable
    def _keep_norm_only_for(self, loss: torch.Tensor) -> None:
        self._mode.keep_norm_only_for(loss, self._max_norm, same_batch=self._one_loss_per_pass)
        if not self._mode.norm_ready:
            self.last_grad_norm = None  # until this step measures its own (or none)

    def _combine(self, pick: Any) -> torch.Tensor:
        """Sum of one per-device tensor over devices, on the first device."""
        values = [pick(s) for s in self._scalars.values()]
        total = values[0].clone()
        for v in values[1:]:
            total += copied_to(v, total.device)
        return total

    def fused_backward(self, loss: torch.Tensor, lr: float | None = None) -> None:
        """Backward with the update applied to each parameter as its gradient is ready.

        `lr` sets the learning rate of every param group (as lomo-optim does); omitted, the
        groups' own lr is used, so torch.optim.lr_scheduler schedulers work.
        """
        self._check_call(loss, lr)
        if self._one_loss_per_pass:
            self._check_sharded_pattern(loss)
        self._keep_norm_only_for(loss)
        if not self._mode.norm_ready:  # else grad_norm(loss) checked this loss
            self._refuse_bypassed_head(loss)
        single = (
            self._single_backward_clip is not None
            and not self._mode.norm_ready
            and self._needs_detection_pass()
        )
        if not self._mode.norm_ready and self._needs_detection_pass() and not single:
            self._norm_pass(loss)  # same attempt as a grad_norm of another loss
        else:
            self._report_previous_step()
            self._prepare_scalars()
        if not self._mode.norm_ready:
            self._refuse_graph(loss)  # no norm pass would meet such a gradient first
        if single:
            self._single_backward_clip.max_norm = self._max_norm
            self._single_backward_clip.begin_step()
        self._mode.begin_update(single)
        try:
            self._run_backward(loss, Phase.UPDATE, retain_graph=False)
        finally:
            detection = self._mode.end_update()
        self._finish_step(detection, single)

    @torch.compiler.disable  # see _check_call
    def _refuse_graph(self, loss: torch.Tensor) -> None:
        def stepped_from_blocks(param: torch.Tensor) -> bool:
            return id(param) in self._group_of and self._eligible_for_row_blocks(param)

        refuse_graph(loss, stepped_from_blocks, self.model)

    @torch.compiler.disable  # see _check_call
    def _refuse_bypassed_head(self, loss: torch.Tensor) -> None:
        """Refuses a loss that reads a patched model's trained head weight other than through
        the fused loss (`head_guard.py`), before anything changes."""
        if isinstance(loss, torch.Tensor):
            refuse_bypassed_head(loss, lambda p: id(p) in self._group_of, self.model)

    # Host-side bookkeeping runs eagerly even inside a compiled training step: traced, it
    # would specialise on the float lr and the step count and recompile every step. Only
    # these helpers are excluded, not the backward: compiled autograd stays on for it.
    @torch.compiler.disable
    def _check_call(self, loss: torch.Tensor, lr: float | None = None) -> None:
        """Checks everything the step reads on the host, before anything changes, then sets
        every group's lr to `lr` when given (as lomo-optim does)."""
        check_loss(loss)
        if not self.attached:
            raise RuntimeError(
                f"this {type(self).__name__} was detached (detach() or the end of its with "
                "block): its hooks are gone; build a new optimizer to train with it"
            )
        self._layout.check(type(self).__name__)
        _compiled_autograd.check_supported()
        groups = self._checked_groups(None if lr is None else check_lr(lr))
        checked_group(self._host_hyper_parameters(), type(self).__name__)
        # The groups as they are now (a parameter may have moved): the hooks read this index.
        self._group_of = current_group_index(
            self.param_groups, self._index_of, lambda: parameter_names(self.model)
        )
        if lr is not None:
            for group in self.param_groups:
                group["lr"] = float(lr)
        self._hook_groups = hook_groups(groups)
        self._max_norm = groups[0]["clip_grad_norm"]
        self._begin_pass_report()

    def _checked_groups(self, lr: float | None = None) -> list[dict[str, Any]]:
        hyper = [key for key in self.defaults if key in CHECKS]  # not torch.optim's own keys
        return checked_groups(self.param_groups, "param_groups", lr, required=hyper)

    @torch.compiler.disable
    def _finish_step(self, detection: bool, single: bool) -> None:
        if single:
            found = self._single_backward_clip.end_step()
            self.last_grad_norm = self._single_backward_clip.last_norm()
        else:
            found = self._combine(lambda s: s.norm_found_inf if detection else s.update_found_inf)
        if self._sharding is not None:
            if not detection and not single:  # every rank reports the same step outcome
                self._sharding.all_reduce_sum_(found)
            self._sharding.after_update()
        self._after_step(found, detection)
        self._queue_report(found, atomic=detection, single_backward=single)
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

    @torch.compiler.disable  # see _check_call
    def _prepare_scalars(self) -> None:
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                scalars = self._scalars_for(p.device)
                lr_t = scalars.lr.get(index)
                if lr_t is None:
                    lr_t = scalars.lr[index] = torch.zeros(1, device=p.device)
                if p.grad is not None:
                    p.grad = None  # stale gradients would be summed into this step's
        for index, group in enumerate(self.param_groups):
            for scalars in self._scalars.values():
                if index in scalars.lr:
                    scalars.lr[index].fill_(group["lr"])
        scaler = self._loss_scaler()
        for scalars in self._scalars.values():
            scalars.update_found_inf.zero_()
            if scaler is not None and scalars.device != scaler.device:
                # One copy per device and step, not one per parameter in the hooks.
                scalars.inv_scale.copy_(scaler.inv_scale, non_blocking=True)
        self.rounding.begin_step(self.step_count, self._scalars)

    def _run_backward(self, loss: torch.Tensor, phase: Phase, retain_graph: bool) -> None:
        scaler = self._loss_scaler()
        with torch.enable_grad():  # the scaled loss needs a graph under torch.no_grad() too
            if scaler is not None:
                loss = loss * copied_to(scaler.scale, loss.device).reshape(())
            elif self._static_inv_scale() != 1.0:
                loss = loss / self._static_inv_scale()
        self._mode.begin_pass(phase)
        self._updated.clear()
        self._begin_row_block_pass()
        tracked = not _compiled_autograd.compiled_autograd_active()
        sharding = self._sharding
        try:
            if sharding is not None:
                sharding.begin()
            loss.backward(retain_graph=retain_graph)
            if sharding is not None:
                self._drain_sharding()  # the last batches, stepped before returning
        except BaseException as error:
            if sharding is not None:
                sharding.abandon()
            # Compilation fails before the graph runs: no parameter has been written.
            if (
                phase is Phase.UPDATE
                and isinstance(error, Exception)
                and _compiled_autograd.is_aliased_input_failure(error)
            ):
                raise RuntimeError(
                    _compiled_autograd.EAGER_FORWARD_MESSAGE.format(version=torch.__version__)
                ) from error
            if phase is Phase.UPDATE:
                self._record_interruption(error, tracked)
            raise
        finally:
            self._mode.end_pass()
            self._updated.clear()
