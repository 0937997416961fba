"""transformers.Trainer that trains with lomo_kernels' Lomo or AdaLomo.

    from lomo_kernels.integrations.hf_trainer import LomoTrainer
    args = TrainingArguments(..., optim="lomo", learning_rate=1e-3, weight_decay=0.01,
                             max_grad_norm=1.0)
    LomoTrainer(model=model, args=args, train_dataset=ds).train()

`optim="adalomo"` selects AdaLomo. Unlike `Trainer(optim="lomo")` with lomo-optim, weight
decay (on the parameters transformers decays: not on norm weights and biases) and
`max_grad_norm` reach the optimizer, the scheduler's learning rate is used every step, the
logged `grad_norm` is the step's gradient norm before clipping, fp16 weights work, and
gradient accumulation (impossible with LOMO) is refused up front. A `Lomo`/`AdaLomo` passed
through `optimizers=(opt, scheduler)` is used as given.

Clipping: exact by default (`max_grad_norm > 0` runs a norm pass, so two backward passes per
step, as lomo-optim); `optim_args="single_backward=True"` clips within one backward
(see trainer_optimizer.py for the trade-off).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import Trainer

from ..optim._in_backward import InBackwardOptimizer
from .huggingface import check_training_arguments, in_backward_optimizer
from .trainer_optimizer import optimizer_class, optimizer_kwargs


def _with_own_training_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Trainer's arguments with a copy of the TrainingArguments in them.

    The trainer turns the Trainer's clipping off in its arguments (and transformers assigns
    other fields of them); the caller's object must stay as given, so that a second trainer
    built from it clips too. A shallow copy: only attributes are assigned, and the copy keeps
    sharing the process-wide accelerate state that the arguments hold.
    """
    if "args" in kwargs:
        kwargs = {**kwargs, "args": copy.copy(kwargs["args"])}
    elif len(args) > 1:
        args = (args[0], copy.copy(args[1]), *args[2:])
    return args, kwargs


class LomoTrainer(Trainer):
    """A Trainer whose training step calls `optimizer.fused_backward(loss)`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        args, kwargs = _with_own_training_arguments(args, kwargs)
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is not None:
            check_training_arguments(targs)
        super().__init__(*args, **kwargs)
        targs = self.args
        given = self.optimizer
        if given is not None and not isinstance(given, InBackwardOptimizer):
            raise TypeError(
                f"LomoTrainer trains with lomo_kernels.Lomo or AdaLomo, got {type(given).__name__}"
            )
        # Clipping happens inside the optimizer (it needs the norm before any update); the
        # Trainer's own clipping would only see freed gradients.
        self.lomo_max_grad_norm = targs.max_grad_norm
        targs.max_grad_norm = 0.0

    def create_optimizer(self, model: torch.nn.Module | None = None) -> InBackwardOptimizer:
        if self.optimizer is None:
            model = self.model if model is None else model
            cls = optimizer_class(self.args.optim)
            self.optimizer = cls(
                model,
                **optimizer_kwargs(
                    self.args,
                    model,
                    self.get_decay_parameter_names(model),
                    max_grad_norm=self.lomo_max_grad_norm,
                ),
            )
        return self.optimizer

    def _lomo(self) -> InBackwardOptimizer:
        return in_backward_optimizer(self.optimizer)  # accelerate wraps the optimizer

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        # The learning rate comes from the param groups, which the scheduler sets.
        self._lomo().fused_backward(loss)
        return loss.detach()

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        # The Trainer would measure the freed gradients (0.0): log the norm the step measured
        # before clipping, or nothing when it measured none (no clipping, not fp16).
        return self._lomo().last_grad_norm
