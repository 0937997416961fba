"""Lomo: lomo-optim's API on fused, sync-free kernels."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..ops.backends import LOMO
from ..ops.lomo import LOMO_UPDATE, lomo_update_int8_op, lomo_update_op
from ._in_backward import InBackwardOptimizer
from .given_parameters import model_and_groups
from .int8_buffer import Int8Buffer
from .loss_scaler import DynamicLossScaler
from .loss_scaling import DynamicScaling, LossScaling
from .parameter_state import ParameterState
from .piece import Piece
from .rounding import parameter_seed
from .validation import computes_in_fp16, split_loss_scale_args

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._in_backward import InBackwardOptions


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
    (docs/benchmarks/quality.md); ``stochastic_rounding=False`` restores it. fp32
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

    _PARAMETER_STATE = ParameterState("Lomo")
    elementwise = True  # plain SGD: rows and slices are stepped on their own
    reads_int8_buffers = True  # its fused update reads the 8-bit accumulation buffer

    def __init__(
        self,
        model: nn.Module | Iterable[Any],
        lr: float = 1e-3,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        weight_decay: float = 0.0,
        loss_scale_args: dict[str, Any] | None = None,
        **options: Unpack[InBackwardOptions],
    ) -> None:
        # Validate everything before hooks are attached to the model's parameters.
        model, options["param_groups"] = model_and_groups(model, options.get("param_groups"))
        scale_args = split_loss_scale_args(dict(loss_scale_args or {}))
        # transformers models return an fp32 loss from fp16 weights: decide by the weights.
        fp16 = computes_in_fp16(model)
        if fp16:
            DynamicLossScaler(torch.device("cpu"), **scale_args)  # validates the arguments

        def loss_scaling(device: torch.device) -> LossScaling:
            if not fp16:
                return LossScaling()
            return DynamicScaling(DynamicLossScaler(device, **scale_args))

        # Per device, what every eager update call of a step passes: the backend module and
        # the inverse loss scale (set once per step, not looked up per call).
        self._step_constants: dict[torch.device, tuple[Any, torch.Tensor | None]] = {}
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "clip_grad_norm": clip_grad_norm,
            "clip_grad_value": clip_grad_value,
        }
        super().__init__(model, defaults, loss_scaling, **options)

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        """The fp16 dynamic loss scaler (lomo-optim's), or None: the trainable parameters do
        not compute in fp16."""
        return self._loss_scaling.scaler

    def _prepare_update_arguments(self) -> None:
        self._step_constants = {
            d: (LOMO.resolve(d, self._backend_name), self._inv_scale_for(d)) for d in self._scalars
        }
        # The update op's public checks (its spec's), once per step, on the step-wide values
        # every per-tensor call of the step passes (`_update` skips them per call).
        for device, scalars, index, group in self._scalars.groups_present(self._groups.hyper):
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
                    "seed": 0,  # per tensor: its index, always valid
                    "seed_step": self.rounding.seed_step(device),
                    "offset": 0,  # per tensor: a slice's flat offset, always valid
                },
            )

    def _update(self, piece: Piece) -> None:
        """Updates `piece` (the parameter, a block of its rows, or this rank's slice of it)
        from its gradient, or from its 8-bit accumulation buffer, in one fused call; a
        stochastically rounded piece rounds as the whole tensor would (the op draws the bits
        of its elements' flat indices in the parameter)."""
        target, grad = piece.written, piece.grad
        stochastic = self.rounding.applies_to(target.dtype)
        seed, seed_step = 0, None
        if stochastic:
            seed = parameter_seed(self._groups.index_of[id(piece.param)])
            seed_step = self.rounding.seed_step(target.device)
        scalars, group, clip_coef = piece.scalars, piece.group, piece.clip_coef
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
        # the op's public checks once this step (_prepare_update_arguments); the binding
        # checks the tensors' shapes and dtypes. In the op's order (LOMO_UPDATE.names and
        # LOMO_UPDATE_INT8.names; each name's value: tests/optim/test_lomo_optimizer.py),
        # which saves building a keyword dict per call.
        if isinstance(grad, Int8Buffer):
            op, read, last = lomo_update_int8_op, (grad.codes, grad.scales, grad.offset), ()
        else:
            op, read, last = lomo_update_op, (grad.contiguous(),), (piece.offset,)
        op.call_in_order(
            backend,
            (
                target,  # param
                *read,  # grad, or codes, scales, offset
                scalars.lr[piece.group_index],  # lr
                inv_scale,  # inv_scale
                group["clip_grad_value"],  # clip_value
                clip_coef,  # clip_coef
                group["weight_decay"],  # weight_decay
                scalars.update_found_inf,  # found_inf
                piece.skip_if,  # skip_if
                stochastic,  # stochastic_rounding
                seed,  # seed
                seed_step,  # seed_step
                *last,  # the dense op's offset: target's flat index in the parameter
            ),
        )
