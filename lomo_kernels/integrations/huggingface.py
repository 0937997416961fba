"""transformers' and accelerate's own LOMO path, served by lomo_kernels' Lomo and AdaLomo.

    import lomo_kernels
    lomo_kernels.enable_transformers()
    Trainer(model, TrainingArguments(..., optim="lomo"), ...).train()  # our Lomo

After `enable_transformers()` (process-wide, undone by `disable_transformers()`):

- `TrainingArguments(optim="lomo" | "adalomo")` builds our `Lomo` / `AdaLomo` with the
  learning rate, `weight_decay` on the parameters the Trainer decays (not norm weights and
  biases: `Trainer.get_decay_parameter_names`), `max_grad_norm` as `clip_grad_norm` (0
  switches clipping off) and `optim_args="single_backward=True"` for clipping within one
  backward per step (default: exact, two backward passes; see trainer_optimizer.py).
- `accelerator.backward(loss)` and `accelerator.backward(loss, learning_rate=lr)` run
  `fused_backward` of the prepared Lomo/AdaLomo; a prepared optimizer has `fused_backward`
  and `grad_norm`.
- `accelerator.clip_grad_norm_(params, max_norm)` returns the step's gradient norm before
  clipping, measured by the optimizer (clipping already happened inside the step, with its
  own `clip_grad_norm`), or None when the step measured none: the Trainer logs the real
  `grad_norm`.
- `gradient_accumulation_steps=k` builds the optimizer with ``accumulation_steps=k``: each
  micro-batch's `accelerator.backward` adds its gradients into the optimizer's buffers, the
  k-th applies the step; a sync step with fewer micro-batches (an epoch's last) applies what
  was accumulated through `optimizer.step()` right after its backward, so the logged
  `grad_norm` is that step's. A micro-batch whose step would not line up with the Trainer's
  (or accelerate's) sync steps is refused before it changes anything.
- What the step cannot honour is refused before the first step: fp16
  autocast (`fp16=True`), DeepSpeed (LomoTrainer serves ZeRO-3), and a Trainer whose
  `max_grad_norm` or `weight_decay` differs from the values a given optimizer was built with.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from transformers import Trainer, TrainingArguments
from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS, OptimizerContext
from transformers.training_args import OptimizerNames

from ..optim._in_backward import InBackwardOptimizer
from ..optim.validation import register_backward_origin_note
from .trainer_optimizer import optimizer_class, optimizer_kwargs
from .trl_trainers import check_trl_trainer

# (id(owner), attribute) -> (owner, the value enable_transformers() replaced); a dict owner
# is patched by key.
_ORIGINALS: dict[tuple[int, str], tuple[Any, Any]] = {}


def in_backward_optimizer(optimizer: Any) -> InBackwardOptimizer | None:
    """The Lomo/AdaLomo inside accelerate's (and DeepSpeed's) wrappers, or None."""
    while optimizer is not None and not isinstance(optimizer, InBackwardOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def refuse_deepspeed(args: TrainingArguments) -> None:
    """Refuses DeepSpeed for transformers' own Trainer (LomoTrainer serves it)."""
    if getattr(args, "deepspeed", None):
        # transformers hands its optimizer to deepspeed.initialize, whose ZeRO optimizer would
        # reduce and keep gradient partitions itself instead of LOMO's hooks.
        raise ValueError(
            "Trainer(optim='lomo'/'adalomo') does not run under TrainingArguments(deepspeed=...):"
            " transformers passes the optimizer to deepspeed.initialize, whose ZeRO optimizer "
            "LOMO cannot share. Use lomo_kernels.integrations.hf_trainer.LomoTrainer with the "
            "same arguments (it builds the ZeRO-3 engine without an optimizer; README, "
            "'Trainer and accelerate'), or the plain loop (examples/zero3_finetune.py)"
        )


def check_training_arguments(args: TrainingArguments) -> None:
    """Refuses the Trainer settings an in-backward optimizer cannot honour."""
    if args.fp16:
        raise ValueError(
            "fp16 autocast (TrainingArguments.fp16=True) needs a GradScaler on the backward "
            "that Lomo runs itself: load the model in float16 instead (Lomo then scales the "
            "loss dynamically), or use bf16"
        )


def check_matches_arguments(optimizer: InBackwardOptimizer, args: TrainingArguments) -> None:
    """Refuses a given optimizer whose clipping or decay differs from the Trainer's: the
    Trainer's own clipping sees no gradient (each is freed inside backward)."""
    max_norm = args.max_grad_norm if args.max_grad_norm else None
    if optimizer.clip_grad_norm != max_norm:
        raise ValueError(
            f"TrainingArguments(max_grad_norm={args.max_grad_norm}) but the optimizer was built "
            f"with clip_grad_norm={optimizer.clip_grad_norm}: LOMO clips inside backward, so "
            "build it with the same value (or set max_grad_norm=0 for no clipping)"
        )
    if optimizer.accumulation_steps != args.gradient_accumulation_steps:
        raise ValueError(
            f"TrainingArguments(gradient_accumulation_steps={args.gradient_accumulation_steps})"
            f" but the optimizer was built with accumulation_steps="
            f"{optimizer.accumulation_steps}: the optimizer applies a step after its own count "
            "of micro-batches, so build it with the same value"
        )
    decays = sorted({group["weight_decay"] for group in optimizer.param_groups})
    if args.weight_decay and args.weight_decay not in decays:
        raise ValueError(
            f"TrainingArguments(weight_decay={args.weight_decay}) but the optimizer was built "
            f"with weight_decay {' and '.join(map(str, decays))}: build it with the same value "
            "(or leave the Trainer's weight_decay at 0)"
        )


# The Trainer whose create_optimizer is running: transformers' handler gets no Trainer, and
# the decay split is the Trainer's (a subclass may override get_decay_parameter_names).
_BUILDING_FOR: ContextVar[Trainer | None] = ContextVar("lomo_kernels_trainer", default=None)


def lomo_optimizer_handler(ctx: OptimizerContext) -> tuple[type, dict[str, Any]]:
    """transformers' handler for optim="lomo"/"adalomo", building this package's classes."""
    if ctx.model is None:
        raise ValueError("LOMO optimizers need the model: pass model= to the Trainer")
    trainer = _BUILDING_FOR.get()
    # Outside a Trainer (get_optimizer_cls_and_kwargs called directly), transformers' own
    # split, which reads nothing of the Trainer.
    decay_names = (
        trainer.get_decay_parameter_names(ctx.model)
        if trainer is not None
        else Trainer.get_decay_parameter_names(None, ctx.model)  # type: ignore[arg-type]
    )
    kwargs = {
        **ctx.optimizer_kwargs,
        **optimizer_kwargs(ctx.args, ctx.model, decay_names, ctx.args.max_grad_norm),
        "model": ctx.model,
    }
    return optimizer_class(ctx.args.optim), kwargs


def _prepared_in_backward(accelerator: Accelerator) -> InBackwardOptimizer | None:
    """The one Lomo/AdaLomo prepared by `accelerator`, or None."""
    found = [o for o in map(in_backward_optimizer, accelerator._optimizers) if o is not None]
    if len(found) > 1:
        raise ValueError(
            "more than one Lomo/AdaLomo was prepared: accelerator.backward(loss) runs one "
            "fused backward; call opt.fused_backward(loss) on each instead"
        )
    return found[0] if found else None


def _check_accelerator(
    accelerator: Accelerator, kwargs: dict[str, Any], optimizer: InBackwardOptimizer
) -> None:
    steps = accelerator.gradient_accumulation_steps
    if not _steps_by_trainer(accelerator) and optimizer.accumulation_steps != steps:
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={steps}) with a Lomo/AdaLomo built with "
            f"accumulation_steps={optimizer.accumulation_steps}: build both with the same "
            "number of micro-batches per step. Nothing was changed."
        )
    if accelerator.scaler is not None:
        raise ValueError(
            "accelerate's fp16 GradScaler cannot scale the backward Lomo runs itself: load the "
            "model in float16 instead (Lomo scales the loss dynamically), or use bf16"
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError(
            "accelerate's DeepSpeed engine keeps its own optimizer: use Lomo(engine) in a plain "
            "loop (README, 'Sharded training')"
        )
    unknown = set(kwargs) - {"learning_rate"}
    if unknown:
        raise TypeError(f"backward with a Lomo/AdaLomo takes learning_rate only, got {unknown}")


# Set on a Trainer's accelerator: the Trainer divides the losses and syncs gradients itself
# (its accelerator keeps gradient_accumulation_steps at 1).
_STEPS_BY_TRAINER = "_lomo_kernels_steps_by_trainer"


def _steps_by_trainer(accelerator: Accelerator) -> bool:
    return getattr(accelerator, _STEPS_BY_TRAINER, False)


def drop_interrupted_step(optimizer: InBackwardOptimizer) -> None:
    """As a training run starts: drops, with a warning, micro-batches an interrupted run left
    pending (the Trainer's own model.zero_grad() drops their .grad in torch's case)."""
    if optimizer.pending_micro_batches:
        warnings.warn(
            f"dropped {optimizer._accumulation.waiting()} that an interrupted training run "
            "left (no parameter was changed by them), as the Trainer's model.zero_grad() "
            "drops accumulated gradients",
            RuntimeWarning,
            stacklevel=3,
        )
        optimizer.zero_grad()


def report_skipped_step(accelerator: Accelerator, optimizer: InBackwardOptimizer) -> None:
    """After the step of a micro-batch the loop synced on: tells accelerate whether the
    optimizer skipped it for an overflow under its fp16 dynamic loss scaler, so that the
    Trainer's lr scheduler holds, as after a step torch's GradScaler skips (without a
    dynamic scaler torch skips no step, and the schedule goes on). Reads the step's overflow
    flag now: one host sync per step, as GradScaler's own."""
    if getattr(optimizer, "loss_scaler", None) is None:
        return
    optimizer.flush_report()
    wrappers = [w for w in accelerator._optimizers if in_backward_optimizer(w) is optimizer]
    if not wrappers:
        # Built after accelerate prepared the engine (LomoTrainer under DeepSpeed), so no
        # wrapper of it is where the Trainer asks whether the step was skipped: add one.
        wrappers = [AcceleratedOptimizer(optimizer, device_placement=False)]
        accelerator._optimizers.extend(wrappers)
    for wrapper in wrappers:
        wrapper._is_overflow = optimizer.last_step_skipped  # read by step_was_skipped


def _backward(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(self: Accelerator, loss: torch.Tensor, **kwargs: Any) -> Any:
        optimizer = _prepared_in_backward(self)
        if optimizer is None:
            return original(self, loss, **kwargs)
        _check_accelerator(self, kwargs, optimizer)
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps  # as accelerate's own backward
        # Without learning_rate the param groups' lr (an lr scheduler's) is used. A Trainer
        # passes its scheduler's lr of the first group only: the groups hold each their own
        # already (a given optimizer's may differ), so it is not written over them.
        lr = None if _steps_by_trainer(self) else kwargs.get("learning_rate")
        optimizer._fused_backward_in_loop(loss, lr, self.sync_gradients)
        if self.sync_gradients:
            report_skipped_step(self, optimizer)

    return backward


def _clip_grad_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    def clip_grad_norm_(
        self: Accelerator, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> Any:
        optimizer = _prepared_in_backward(self)
        if optimizer is None:
            return original(self, parameters, max_norm, norm_type)
        if max_norm != float("inf") and max_norm != optimizer.clip_grad_norm:
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}) after a LOMO step: the step already ran "
                f"with the optimizer's clip_grad_norm={optimizer.clip_grad_norm} (gradients are "
                "freed inside backward); build the optimizer with clip_grad_norm=max_norm"
            )
        # The norm the step measured (clipping or fp16): a device tensor, None when unmeasured.
        return optimizer.last_grad_norm

    return clip_grad_norm_


def _create_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_optimizer(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        check_trl_trainer(self)  # a TRL trainer Lomo/AdaLomo do not serve, before anything
        token = _BUILDING_FOR.set(self)
        try:
            optimizer = original(self, *args, **kwargs)
        finally:
            _BUILDING_FOR.reset(token)
        lomo = in_backward_optimizer(optimizer)
        if lomo is not None:  # checked before the first step changes anything
            drop_interrupted_step(lomo)
            setattr(self.accelerator, _STEPS_BY_TRAINER, True)
            refuse_deepspeed(self.args)
            check_training_arguments(self.args)
            check_matches_arguments(lomo, self.args)
        return optimizer

    return create_optimizer


def _fused_backward(self: AcceleratedOptimizer, loss: torch.Tensor, lr: float | None = None) -> Any:
    return self.optimizer.fused_backward(loss, lr)


def _grad_norm(self: AcceleratedOptimizer, loss: torch.Tensor) -> Any:
    return self.optimizer.grad_norm(loss)


def _patch(owner: Any, name: str, new: Any) -> None:
    if (id(owner), name) in _ORIGINALS:
        return
    if isinstance(owner, dict):
        _ORIGINALS[id(owner), name] = (owner, owner[name])
        owner[name] = new
    else:
        _ORIGINALS[id(owner), name] = (owner, owner.__dict__.get(name))
        setattr(owner, name, new)


def enable_transformers() -> None:
    """Makes transformers' `optim="lomo"/"adalomo"` and accelerate's LOMO path use this
    package's Lomo and AdaLomo (module docstring). Idempotent; `disable_transformers()`
    undoes it."""
    for name in (OptimizerNames.LOMO, OptimizerNames.ADALOMO):
        _patch(_OPTIMIZER_HANDLERS, name, lomo_optimizer_handler)
    _patch(Accelerator, "backward", _backward(Accelerator.backward))
    _patch(Accelerator, "clip_grad_norm_", _clip_grad_norm(Accelerator.clip_grad_norm_))
    _patch(Trainer, "create_optimizer", _create_optimizer(Trainer.create_optimizer))
    _patch(AcceleratedOptimizer, "fused_backward", _fused_backward)
    _patch(AcceleratedOptimizer, "grad_norm", _grad_norm)


def transformers_enabled() -> bool:
    """Whether `enable_transformers()` is in effect."""
    return bool(_ORIGINALS)


def _backward_origin_note() -> str | None:
    """What a stray backward means while `enable_transformers()` is active (the optimizers'
    refusal adds it)."""
    if not transformers_enabled():
        return None
    return (
        "lomo_kernels.enable_transformers() is active, so transformers' Trainer "
        "and accelerator.backward(loss) already run opt.fused_backward: this backward came "
        "from elsewhere (your own loss.backward(), or a library calling it directly); "
        "call opt.fused_backward(loss) there instead, once per step."
    )


register_backward_origin_note(_backward_origin_note)


def disable_transformers() -> None:
    """Restores what `enable_transformers()` replaced."""
    for (_, name), (owner, original) in reversed(list(_ORIGINALS.items())):
        if isinstance(owner, dict):
            owner[name] = original
        elif original is None:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _ORIGINALS.clear()
