"""Lomo: lomo-optim's API on fused, sync-free kernels."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..distributed import DEFAULT_BUCKET_NUMEL
from ..ops.backends import LOMO
from ..ops.lomo import LOMO_UPDATE, lomo_update_op
from ._in_backward import InBackwardOptimizer, _DeviceScalars
from .given_parameters import model_and_groups
from .loss_scaler import DynamicLossScaler
from .rounding import WriteBackRounding
from .sharded_steps import SliceBatch
from .validation import computes_in_fp16, split_loss_scale_args


class Lomo(InBackwardOptimizer):
    """LOw-Memory Optimization: SGD applied to each parameter inside backward.

    Drop-in for ``lomo_optim.Lomo`` (same arguments and defaults, ``fused_backward(loss, lr)``
    and ``grad_norm(loss)``). Differences, all fixes: ``lr`` may be omitted (the param groups'
    lr is used, so lr schedulers work); fp16 loss scaling is switched on by the dtype of the
    trainable parameters (not of the loss) and its scale grows back after ``scale_window``
    clean steps; an overflowing fp16 step changes nothing; with ``clip_grad_norm``,
    ``fused_backward`` runs the norm pass itself when ``grad_norm`` was not called for this
    loss; ``state_dict()`` carries the step count and the loss scaler.

    A deliberate difference: bf16 and fp16 parameters are written back with stochastic
    rounding by default (``stochastic_rounding=True``; unbiased, seeded from ``seed``, the
    step and the element's index, so a slice or shard rounds as the whole tensor would).
    Round-to-nearest, lomo-optim's, drops most updates at fine-tuning learning rates
    (BENCHMARKS.md, "Fine-tuning quality"); ``stochastic_rounding=False`` restores it. fp32
    parameters are never rounded.

    ``model``: the model, as lomo-optim takes it, or what a torch optimizer takes (its
    parameters, ``named_parameters()`` or param-group dicts;
    ``lomo_kernels.optim.given_parameters``).

    Extra keyword-only options:
    ``backend`` ('triton', 'cpp', 'torch' or None for automatic), ``single_backward``,
    ``replicated`` (False: under torch.distributed, each rank's parameters are its own) and
    ``param_groups`` (torch-style groups of the model's parameters, by tensor or name, with
    their own lr, weight_decay or clip_grad_value; unlisted parameters keep the constructor's
    values: ``lomo_kernels.optim.param_groups``).

    On a model patched by ``lomo_kernels.patch_causal_lm`` the head and the input embedding
    (untied, unsharded, eager backward) are stepped from blocks of their rows' gradients, so
    neither ``vocab x hidden`` gradient exists (``lomo_kernels.optim.row_blocks``).

    ``single_backward=True``: one backward per step with ``clip_grad_norm`` and in fp16 (the
    default False keeps lomo-optim's norm pass, i.e. exact clipping and atomic fp16 steps).
    Each gradient is clipped with ``c_i = min(1, M / (max(P, sqrt(S_i)) + 1e-6))``, P the
    median of the last three steps' norms, S_i this step's running sum of squares; the applied
    gradient's norm is at most ``M * sqrt(1 + 2 ln(||g|| / max(P, ||g_first||)))`` and at
    most M when P >= ||g|| (see ``lomo_kernels.optim.single_backward``). A tensor whose gradient
    has inf/nan is left unchanged, the others are updated, the scale is lowered: an
    overflowing fp16 step is *partial* (``last_step_partial``). Under ZeRO-3 and FSDP2 too
    (every rank applies the same coefficients and skips; no second forward under ZeRO-3).
    """

    _STATE_FORMAT = "Lomo"

    def __init__(
        self,
        model: nn.Module | Iterable[Any],
        lr: float = 1e-3,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        weight_decay: float = 0.0,
        loss_scale_args: dict[str, Any] | None = None,
        *,
        stochastic_rounding: bool = True,
        seed: int = 0,
        backend: str | None = None,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        single_backward: bool = False,
        replicated: bool = True,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        # Validate everything before hooks are attached to the model's parameters.
        model, param_groups = model_and_groups(model, param_groups)
        rounding = WriteBackRounding(stochastic_rounding, seed)
        scale_args = split_loss_scale_args(dict(loss_scale_args or {}))
        fp16 = computes_in_fp16(model)
        if fp16:
            DynamicLossScaler(torch.device("cpu"), **scale_args)  # validates the arguments
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "clip_grad_norm": clip_grad_norm,
            "clip_grad_value": clip_grad_value,
        }
        super().__init__(
            model,
            defaults,
            backend=backend,
            bucket_numel=bucket_numel,
            single_backward=single_backward,
            replicated=replicated,
            param_groups=param_groups,
            rounding=rounding,
        )
        # Per device, what every eager update call of a step passes: the backend module and
        # the inverse loss scale (set once per step, not looked up per call).
        self._step_constants: dict[torch.device, tuple[Any, torch.Tensor | None]] = {}
        params = [p for g in self.param_groups for p in g["params"]]
        # transformers models return an fp32 loss from fp16 weights: decide by the weights.
        self.loss_scaler: DynamicLossScaler | None = None
        if fp16:
            self.loss_scaler = DynamicLossScaler(params[0].device, **scale_args)
            # Whether a norm pass of the current step attempt applied an overflow.
            self._overflow_applied = torch.zeros(1, dtype=torch.bool, device=params[0].device)

    def _loss_scaler(self) -> DynamicLossScaler | None:
        return self.loss_scaler

    @torch.compiler.disable  # host-side, as InBackwardOptimizer._prepare_scalars
    def _prepare_scalars(self) -> None:
        super()._prepare_scalars()
        self._step_constants = {
            d: (LOMO.resolve(d, self._backend_name), self._inv_scale_for(d)) for d in self._scalars
        }
        self._check_update_arguments()

    def _check_update_arguments(self) -> None:
        """The update op's public checks (its spec's), once per step, on the step-wide values
        every per-tensor call of the step passes (`_apply` skips them per call)."""
        for device, scalars in self._scalars.items():
            for index, group in enumerate(self._hook_groups):
                if index not in scalars.lr:
                    continue  # no parameter of this group on this device
                LOMO_UPDATE.convert(
                    device,
                    {
                        "param": None,
                        "grad": None,
                        "lr": scalars.lr[index],
                        "inv_scale": self._step_constants[device][1],
                        "clip_value": group["clip_grad_value"],
                        "clip_coef": scalars.clip_coef,
                        "weight_decay": group["weight_decay"],
                        "found_inf": scalars.update_found_inf,
                        "skip_if": scalars.update_found_inf,
                        "stochastic_rounding": self.rounding.stochastic,
                        "seed": 0,  # per tensor: its index (or slice offset), always valid
                        "seed_step": self.rounding.seed_step(device),
                    },
                )

    def _needs_detection_pass(self) -> bool:
        # fp16 overflows are common: find them before any parameter changes.
        return self.loss_scaler is not None or self._max_norm is not None

    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        group: dict[str, Any],
        scalars: _DeviceScalars,
        skip_if: torch.Tensor,
    ) -> None:
        self._apply(param, param, 0, grad, group, scalars, skip_if)

    def update_rows(
        self,
        param: torch.Tensor,
        start: int,
        stop: int,
        grad: torch.Tensor,
        skip_if: torch.Tensor,
    ) -> None:
        """Steps rows ``[start, stop)`` of `param` from their fp32 gradient `grad` exactly as
        the whole tensor's step would (`row_blocks.py`)."""
        group = self._hook_groups[self._group_of[id(param)]]
        scalars = self._scalars_for(param.device)
        first = start * (param.numel() // param.shape[0])
        self._apply(param, param[start:stop], first, grad, group, scalars, skip_if)

    def _update_shards(self, batch: SliceBatch) -> None:
        # Plain SGD is elementwise: each slice is updated on its own, with the fused op.
        for i, (shard, grad) in enumerate(batch.entries):
            if shard.local.numel():
                group = self._hook_groups[self._group_of[id(shard.param)]]
                self._apply(
                    shard.param,
                    shard.local,
                    shard.offset,
                    grad,
                    group,
                    batch.scalars,
                    batch.skip_of(i),
                    batch.clip_coef_of(i),
                )

    def _apply(
        self,
        param: torch.Tensor,
        target: torch.Tensor,
        offset: int,
        grad: torch.Tensor,
        group: dict[str, Any],
        scalars: _DeviceScalars,
        skip_if: torch.Tensor,
        clip_coef: torch.Tensor | None = None,
    ) -> None:
        """Updates `target` (the parameter, or its contiguous slice starting at flat
        `offset`); `clip_coef` replaces the step-wide coefficient (single_backward under
        sharding). A stochastically rounded slice rounds as the whole tensor would."""
        if not self.rounding.applies_to(target.dtype):
            self._apply_piece(param, target, grad, group, scalars, skip_if, clip_coef)
            return
        flat, flat_grad = target.reshape(-1), grad.reshape(-1)
        seeds_step = self.rounding.seed_step(target.device)

        def piece(a: int, b: int, seed: int) -> None:
            whole = a == 0 and b == flat.numel()  # the tensors as given (a traced step's)
            self._apply_piece(param, target if whole else flat[a:b],
                              grad if whole else flat_grad[a:b], group, scalars, skip_if,
                              clip_coef, (seed, seeds_step))  # fmt: skip

        self.rounding.in_pieces(self._index_of[id(param)], offset, flat.numel(), piece)

    def _apply_piece(
        self,
        param: torch.Tensor,
        target: torch.Tensor,
        grad: torch.Tensor,
        group: dict[str, Any],
        scalars: _DeviceScalars,
        skip_if: torch.Tensor,
        clip_coef: torch.Tensor | None,
        seeds: tuple[int, torch.Tensor | None] | None = None,
    ) -> None:
        """One fused update call on `target`; `seeds`: (seed, seed_step) of its stochastic
        rounding, None to round to nearest."""
        seed, seed_step = (0, None) if seeds is None else seeds
        device = scalars.device  # target's
        if torch.compiler.is_compiling():
            # Traced: the device's backend, and nothing read from host-side caches.
            backend, inv_scale = None, self._inv_scale_for(device)
        else:
            backend, inv_scale = self._step_constants[device]
        if group["clip_grad_norm"] is None:
            clip_coef = None
        elif clip_coef is None:
            clip_coef = scalars.clip_coef
        # The op as the public function runs it, without the public function's per-call
        # conversions: every value here is the optimizer's own, in the op's form, and passed
        # the op's public checks once this step (_check_update_arguments); the binding checks
        # the tensors' shapes and dtypes. In the op's order (LOMO_UPDATE.names; each name's
        # value: tests/test_lomo_optimizer.py), which saves building a keyword dict per call.
        lomo_update_op.call_in_order(
            backend,
            (
                target,  # param
                grad.contiguous(),  # grad
                scalars.lr[self._group_of[id(param)]],  # lr
                inv_scale,  # inv_scale
                group["clip_grad_value"],  # clip_value
                clip_coef,  # clip_coef
                group["weight_decay"],  # weight_decay
                scalars.update_found_inf,  # found_inf
                skip_if,  # skip_if
                seeds is not None,  # stochastic_rounding
                seed,  # seed
                seed_step,  # seed_step
            ),
        )

    def _begin_attempt(self) -> None:
        if self.loss_scaler is not None:
            self._overflow_applied.zero_()

    def _after_norm_pass(self, found_inf: torch.Tensor) -> None:
        # As lomo-optim: an overflow found by the norm pass lowers the scale now, so a loop
        # that skips the update pass on has_overflow_serial (its trainer's) still backs off;
        # once per attempt (fused_backward re-measures another loss than grad_norm's).
        if self.loss_scaler is not None:
            found = found_inf.to(self.loss_scaler.device).reshape(1) != 0
            self.loss_scaler.update(found, apply=found & ~self._overflow_applied)
            self._overflow_applied |= found

    def _after_step(self, found_inf: torch.Tensor, detection: bool) -> None:
        if self.loss_scaler is not None:
            found = found_inf.to(self.loss_scaler.device).reshape(1) != 0
            # An overflow a norm pass applied is this step's outcome (see _after_norm_pass).
            apply = ~self._overflow_applied & (~found if detection else True)
            self.loss_scaler.update(found, apply=apply)
            self._overflow_applied.zero_()

    def _load_scaler_state(self, state: dict[str, Any] | None) -> None:
        if state is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state)
