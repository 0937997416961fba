"""AdaLomo: lomo-optim's AdaLomo API on fused factored-moment kernels."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..distributed import Shard, unwrap_engine
from ..ops.adalomo import (
    adalomo_step_arguments,
    adalomo_update_,
    check_adalomo_state,
    init_adalomo_state,
    run_adalomo_passes_,
)
from ..ops.adalomo.workspace import workspace_numel
from ..ops.backends import ADALOMO
from ._hyper import check_loss_scale
from ._in_backward import InBackwardOptimizer
from .adalomo_slices import SliceStep, adalomo_slices_, init_slice_state
from .given_parameters import model_and_groups
from .loss_scaling import LossScaling, StaticLossScale
from .param_groups import GroupHyperParameter
from .parameter_state import ParameterState, State, non_finite
from .piece import Piece, PieceBatch
from .rounding import parameter_seed
from .validation import computes_in_fp16, parameter_names, trainable_parameters

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._in_backward import InBackwardOptions


def check_factorable(model: nn.Module, params: list[nn.Parameter]) -> None:
    """Refuses a matrix with an empty last dimension: its factored moments would average
    over no column."""
    names = parameter_names(unwrap_engine(model))
    for p in params:
        if p.dim() >= 2 and p.shape[-1] == 0:
            raise ValueError(
                f"parameter {names.get(id(p), '?')!r} has shape {tuple(p.shape)}: AdaLomo's "
                "factored moments average over the last dimension, which is empty; freeze it "
                "(requires_grad=False) or give it a non-empty shape"
            )


def _initial_moments(param: nn.Parameter, shard: Shard | None) -> State:
    """Zero moments: of the whole parameter, or R, C of the full matrix and the slice's v."""
    return init_adalomo_state(param) if shard is None else init_slice_state(shard)


def _moments_problem(values: torch.Tensor) -> str | None:
    problem = non_finite(values)
    if problem is None and bool((values < 0).any()):
        problem = "holds negative values (second moments are averages of squares)"
    return problem


MOMENTS = ParameterState(
    "AdaLomo",
    initial=_initial_moments,
    # R and C are whole on every rank (built from all-reduced sums); a 1-D parameter's v is
    # sliced like the parameter.
    sliced=frozenset({"exp_avg_sq"}),
    problem=_moments_problem,
    lomo_optim_gap=(
        "a lomo_optim.AdaLomo state_dict holds no second moments and no step count "
        "(lomo-optim keeps them outside its state): only its hyper-parameters were "
        "loaded; this optimizer's moments and step count are kept"
    ),
)


class AdaLomo(InBackwardOptimizer):
    """LOMO with Adafactor-style factored second moments (no first moment), in backward.

    Drop-in for ``lomo_optim.AdaLomo`` (same arguments and defaults). Differences, all
    fixes: the moments live in ``self.state`` on each parameter's device, only for trainable
    parameters, and ``state_dict()`` carries them with the step count; a gradient with
    inf/nan leaves the parameter and its moments unchanged (fp16 and clip-by-norm runs check
    every gradient first, so an overflowing step changes nothing at all); ``lr`` may be
    omitted so lr schedulers work; no fp32 copy of any whole tensor is made.

    A deliberate difference: bf16 and fp16 parameters are written back with stochastic
    rounding by default (``stochastic_rounding=True``, keyword-only, seeded from ``seed``,
    the step and the element's index; a shard rounds as the whole tensor would). AdaLomo's
    update is relative (about ``lr * rms(p)`` per element), so at fine-tuning learning rates
    round-to-nearest, lomo-optim's, returns most weights unchanged (docs/benchmarks/quality.md);
    ``stochastic_rounding=False`` restores it. fp32 parameters are
    never rounded.

    ``model``: the model, as lomo-optim takes it, or what a torch optimizer takes (its
    parameters, ``named_parameters()`` or param-group dicts;
    ``lomo_kernels.optim.given_parameters``).

    ``single_backward=True`` (keyword-only; default False, lomo-optim's two passes): one
    backward per step with ``clip_grad_norm`` and in fp16. Only the clip coefficient changes
    (the update normalisation and lr scaling are per tensor): each gradient gets
    ``c_i = min(1, M / (max(P, sqrt(S_i)) + 1e-6))``, P the median of the last three steps'
    norms, S_i this step's running sum of squares, so the clipped gradient's norm is at most
    ``M * sqrt(1 + 2 ln(||g|| / max(P, ||g_first||)))`` and at most M when P >= ||g||
    (see ``lomo_kernels.optim.single_backward``). A tensor whose gradient has inf/nan keeps its
    values and moments, the others are updated: an overflowing step is *partial*
    (``last_step_partial``; AdaLomo's loss scale is static, as in lomo-optim). Under ZeRO-3
    and FSDP2 too (every rank applies the same coefficients and skips).

    ``param_groups`` (keyword-only): torch-style groups of the model's parameters, by tensor
    or name, with their own lr, weight_decay, eps, clip_threshold, decay_rate or
    clip_grad_value; unlisted parameters keep the constructor's values
    (``lomo_kernels.optim.param_groups``).
    """

    _PARAMETER_STATE = MOMENTS
    _loss_scaling: StaticLossScale

    def __init__(
        self,
        model: nn.Module | Iterable[Any],
        lr: float = 1e-3,
        loss_scale: float = 2**10,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        weight_decay: float = 0.0,
        **options: Unpack[InBackwardOptions],
    ) -> None:
        # Validate everything before hooks are attached to the model's parameters.
        model, options["param_groups"] = model_and_groups(model, options.get("param_groups"))
        check_factorable(model, trainable_parameters(model))
        scaling = StaticLossScale(check_loss_scale(loss_scale), computes_in_fp16(model))

        def loss_scaling(device: torch.device) -> LossScaling:
            return scaling

        self._beta2: dict[tuple[torch.device, int], torch.Tensor] = {}
        # Per device: the backend module every eager update call of a step runs (resolved
        # once per step). Per (device, group index): the step-wide arguments of its passes,
        # checked and converted once per step (_prepare_update_arguments).
        self._backends: dict[torch.device, Any] = {}
        self._step_arguments: dict[tuple[torch.device, int], dict[str, Any]] = {}
        # Zeroed again for each eager update, not allocated per call: the passes of one
        # parameter, and the parameters one after another, run in the order of the device's
        # stream (CPU: in program order), so a workspace is free again when the next update
        # zeroes it. Keyed by stream on CUDA, as the caching allocator keys its blocks.
        self._workspaces: dict[tuple[Any, ...], torch.Tensor] = {}
        defaults = {
            "lr": lr,
            "eps": eps,
            "weight_decay": weight_decay,
            "clip_threshold": clip_threshold,
            "decay_rate": decay_rate,
            "clip_grad_norm": clip_grad_norm,
            "clip_grad_value": clip_grad_value,
        }
        super().__init__(model, defaults, loss_scaling, **options)
        # For the moments' refusal: taken while FSDP2 registers the sharded parameters (from
        # a forward to its backward, the root unit's gathered ones stand in their place).
        self._moment_names = parameter_names(self.model)

    # lomo-optim's attribute names for AdaLomo's hyper-parameters (see GroupHyperParameter).
    eps = GroupHyperParameter("eps")
    decay_rate = GroupHyperParameter("decay_rate")
    clip_threshold = GroupHyperParameter("clip_threshold")

    @property
    def loss_scale(self) -> float:
        """lomo-optim's static loss scale; a new value is checked at the next step."""
        return self._loss_scaling.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._loss_scaling.loss_scale = value

    @property
    def step_num(self) -> int:
        """lomo-optim's step counter: the number of update passes run (``step_count``)."""
        return self.step_count

    def _prepare_update_arguments(self) -> None:
        t = self.step_count + 1  # lomo-optim counts the step before its backward
        # beta2 changes every step: a device tensor, so a compiled backward is not rebuilt.
        for group_index, group in enumerate(self._groups.hyper):
            beta2 = 1.0 - math.pow(t, group["decay_rate"])
            for device in self._scalars:
                key = (device, group_index)
                if key not in self._beta2:
                    self._beta2[key] = torch.zeros(1, device=device)
                self._beta2[key].fill_(beta2)
        self._backends = {d: ADALOMO.resolve(d, self._backend_name) for d in self._scalars}
        self._check_update_arguments()

    def _check_update_arguments(self) -> None:
        """The update's public checks (`ops.adalomo_update_`'s), once per step, on the values
        every per-tensor call of the step passes (`_update` skips them per call), and the
        moments' form, sliced ones' too (`adalomo_slices_` reads them unchecked); a value not
        in the op's form is refused before any parameter changes."""
        self._step_arguments = {}
        for device, scalars, index, group in self._scalars.groups_present(self._groups.hyper):
            clip = group["clip_grad_norm"] is not None
            self._step_arguments[device, index] = adalomo_step_arguments(
                device,
                True,  # the factored passes take every step-wide argument
                lr=scalars.lr[index],
                beta2=self._beta2[device, index],
                eps=group["eps"],
                clip_threshold=group["clip_threshold"],
                weight_decay=group["weight_decay"],
                inv_scale=self._inv_scale_for(device),
                clip_value=group["clip_grad_value"],
                clip_coef=scalars.clip_coef if clip else None,
                found_inf=scalars.update_found_inf,
                # Per call: one of the optimizer's own flags (or None), like this one.
                skip_if=scalars.norm_found_inf,
                # Per call: whether the parameter's dtype is rounded, and its index.
                stochastic_rounding=self.rounding.stochastic,
                seed=0,
                seed_step=self.rounding.seed_step(device),
            )
        for group in self.param_groups:
            for param in group["params"]:
                self._check_moments(param)

    def _check_moments(self, param: nn.Parameter) -> None:
        """Refuses `param`'s moments, naming it, unless they are in the form this optimizer
        keeps (`_initial_moments`: the whole parameter's, or this rank's slice's)."""
        state = self.state[param]
        try:
            if self._sharding is None:
                check_adalomo_state(param, state)
            else:
                shard = self._sharding.shard(param)
                check_adalomo_state(shard.local, state, shard.full_shape)
        except (TypeError, ValueError) as error:
            name = self._moment_names.get(id(param), "?")
            problem = str(error).removeprefix("lomo_kernels: ")
            raise type(error)(
                f"AdaLomo's moments of parameter {name!r} are damaged: {problem}. The step "
                "was refused before any parameter, moment or lr changed: load a state_dict "
                "this optimizer saved (load_state_dict checks the moments), or build a new "
                "optimizer to start them from zero"
            ) from error

    def _update_measures(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        # Factored: pass A measures the gradient's sum of squares and non-finite flag (no
        # separate read), and a non-finite gradient skips the tensor through its SKIP slot.
        return param.dim() >= 2 and grad.numel() > 0

    def _update(self, piece: Piece) -> None:
        # A whole tensor: the factored statistics span the matrix (slices: _update_shards).
        param, group, scalars = piece.param, piece.group, piece.scalars
        if torch.compiler.is_compiling():
            # Traced: the public function as it is, nothing read from host-side caches.
            adalomo_update_(
                param,
                piece.grad,
                self.state[param],
                lr=scalars.lr[piece.group_index],
                beta2=self._beta2[param.device, piece.group_index],
                eps=group["eps"],
                clip_threshold=group["clip_threshold"],
                weight_decay=group["weight_decay"],
                inv_scale=self._inv_scale_for(param.device),
                clip_value=group["clip_grad_value"],
                clip_coef=scalars.clip_coef if group["clip_grad_norm"] is not None else None,
                found_inf=scalars.update_found_inf,
                skip_if=piece.skip_if,
                **self._rounding_arguments(param),
                backend=self.backend,
                on_grad_sumsq=piece.on_grad_sumsq,
            )
            return
        if not param.numel():
            return
        # The public function's passes without its per-call checks and conversions: the
        # step-wide values passed them this step, the state's form too; the rest is the
        # parameter, its gradient and one of the optimizer's own flags.
        device = param.device
        arguments = {
            **self._step_arguments[device, piece.group_index],
            **self.state[param],
            "param": param,
            "grad": piece.grad.contiguous(),
            "skip_if": piece.skip_if,
            "workspace": self._workspace(param),
            **self._rounding_arguments(param),
        }
        run_adalomo_passes_(self._backends[device], arguments, piece.on_grad_sumsq)

    def _rounding_arguments(self, param: torch.Tensor) -> dict[str, Any]:
        """The write-back's rounding arguments of `param` (rounding.py)."""
        stochastic = self.rounding.applies_to(param.dtype)
        return {
            "stochastic_rounding": stochastic,
            "seed": parameter_seed(self._groups.index_of[id(param)]) if stochastic else 0,
            "seed_step": self.rounding.seed_step(param.device) if stochastic else None,
        }

    def _workspace(self, param: torch.Tensor) -> torch.Tensor:
        """A zeroed fp32 workspace for one eager update of `param` (see `_workspaces`)."""
        device = param.device
        key = (device, param.shape)
        if param.is_cuda:
            key += (torch.cuda.current_stream(device).cuda_stream,)
        workspace = self._workspaces.get(key)
        if workspace is None:
            numel = workspace_numel(param.shape)
            workspace = torch.empty(numel, dtype=torch.float32, device=device)
            self._workspaces[key] = workspace
        return workspace.zero_()

    def _update_shards(self, batch: PieceBatch) -> None:
        # Row/column statistics span ranks: the whole batch is stepped together, with two
        # small all-reduces (see adalomo_slices.py).
        steps = []
        for piece in batch.pieces:
            shard, index, group = piece.shard, piece.group_index, piece.group
            device = shard.local.device
            clip_coef = piece.clip_coef if piece.clip_coef is not None else batch.scalars.clip_coef
            arguments = {
                **self._step_arguments[device, index],
                "lr": batch.scalars.lr[index],
                "clip_coef": clip_coef if group["clip_grad_norm"] is not None else None,
                **self._rounding_arguments(shard.param),
            }
            steps.append(
                SliceStep(
                    shard=shard,
                    grad=piece.grad,
                    state=self.state[shard.param],
                    arguments=arguments,
                    skip=piece.skip_if,
                    backend=self._backends[device],
                )
            )
        found_inf = batch.scalars.update_found_inf
        all_reduce_sum_ = self._sharding.all_reduce_sum_
        adalomo_slices_(steps, batch.skip_if, found_inf, all_reduce_sum_)
