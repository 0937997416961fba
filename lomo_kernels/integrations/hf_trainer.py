"""transformers.Trainer that trains with lomo_kernels' Lomo or AdaLomo.

    from lomo_kernels.integrations.hf_trainer import LomoTrainer
    args = TrainingArguments(..., optim="lomo", learning_rate=1e-3, weight_decay=0.01,
                             max_grad_norm=1.0)
    LomoTrainer(model=model, args=args, train_dataset=ds).train()

`optim="adalomo"` selects AdaLomo. Unlike `Trainer(optim="lomo")`, weight decay and
`max_grad_norm` reach the optimizer, the scheduler's learning rate is used every step, fp16
weights work, and gradient accumulation (impossible with LOMO) is refused up front. A
`Lomo`/`AdaLomo` passed through `optimizers=(opt, scheduler)` is used as given.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import Trainer

from ..optim import AdaLomo, Lomo
from ..optim._in_backward import InBackwardOptimizer
from .huggingface import check_training_arguments, in_backward_optimizer


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
        self.lomo_max_grad_norm = targs.max_grad_norm if targs.max_grad_norm else None
        targs.max_grad_norm = 0.0

    def create_optimizer(self, model: torch.nn.Module | None = None) -> InBackwardOptimizer:
        if self.optimizer is None:
            name = str(getattr(self.args.optim, "value", self.args.optim)).lower()
            if name not in ("lomo", "adalomo"):
                raise ValueError(
                    f"LomoTrainer needs TrainingArguments(optim='lomo' or "
                    f"'adalomo'), got optim={name!r}"
                )
            cls = Lomo if name == "lomo" else AdaLomo
            self.optimizer = cls(
                self.model,
                lr=self.args.learning_rate,
                clip_grad_norm=self.lomo_max_grad_norm,
                weight_decay=self.args.weight_decay,
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
