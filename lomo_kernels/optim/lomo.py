"""Lomo: lomo-optim's API on fused, sync-free kernels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._rounding import aligned_pieces, mix32_int, seed_at_offset
from ..distributed import DEFAULT_BUCKET_NUMEL
from ..ops.backends import LOMO
from ..ops.lomo import LOMO_UPDATE, lomo_update_op
from ._in_backward import InBackwardOptimizer, _DeviceScalars
from .loss_scaler import DynamicLossScaler
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

    Extra keyword-only options: ``stochastic_rounding`` (bf16 parameters, unbiased rounding
    of the write-back; seeded from ``seed``, the step and the parameter index, the step's
    part kept in a device tensor so a compiled backward is not rebuilt each step),
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
        model: nn.Module,
        lr: float = 1e-3,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        weight_decay: float = 0.0,
        loss_scale_args: dict[str, Any] | None = None,
        *,
        stochastic_rounding: bool = False,
        seed: int = 0,
        backend: str | None = None,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        single_backward: bool = False,
        replicated: bool = True,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        # Validate everything before hooks are attached to the model's parameters.
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
        )
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed)
        # Per device: the per-step part of the rounding seed, refreshed in place each step
        # and read by the kernels, so a compiled backward does not depend on the step.
        self._seed_steps: dict[torch.device, torch.Tensor] = {}
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
        if self.stochastic_rounding:
            # Distinct per (seed, step); 31 bits, so each (seed, step, parameter, slice) keeps
            # the stream of the 63-bit seed ``step_key << 32 | index``.
            step_key = mix32_int(self.seed ^ mix32_int(self.step_count)) & 0x7FFFFFFF
            for device in self._scalars:
                seed_step = self._seed_steps.get(device)
                if seed_step is None:
                    seed_step = torch.zeros(1, dtype=torch.int64, device=device)
                    self._seed_steps[device] = seed_step
                seed_step.fill_(step_key)
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
                        "stochastic_rounding": self.stochastic_rounding,
                        "seed": 0,  # per tensor: its index (or slice offset), always valid
                        "seed_step": self._seed_steps.get(device),
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
        if not (self.stochastic_rounding and param.dtype == torch.bfloat16):
            self._apply(param, param[start:stop], 0, grad, group, scalars, skip_if)
            return
        # Each aligned piece is rounded with the bits its elements have in the whole tensor.
        flat, flat_grad = param.view(-1), grad.reshape(-1)
        first = start * (param.numel() // param.shape[0])
        seed = self._index_of[id(param)]
        for a, b in aligned_pieces(first, first + flat_grad.numel()):
            piece_grad = flat_grad[a - first : b - first]
            self._apply(param, flat[a:b], 0, piece_grad, group, scalars, skip_if,
                        rounding_seed=seed_at_offset(seed, a))  # fmt: skip

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
        rounding_seed: int | None = None,
    ) -> None:
        """Updates `target` (the parameter, or its slice starting at flat `offset`);
        `clip_coef` replaces the step-wide coefficient (single_backward under sharding),
        `rounding_seed` the stochastic rounding's per-parameter seed."""
        use_sr = self.stochastic_rounding and target.dtype == torch.bfloat16
        seed, seed_step = 0, None
        if use_sr:
            # The same every step: distinct per (parameter, slice). The step's part is the
            # device tensor, XORed into the seed's high half by the kernel.
            seed = self._index_of[id(param)] if rounding_seed is None else rounding_seed
            if offset:
                seed = mix32_int(seed ^ mix32_int(offset))
            seed_step = self._seed_steps[target.device]
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
                use_sr,  # stochastic_rounding
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
