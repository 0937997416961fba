"""transformers.Trainer that trains with lomo_kernels' Lomo or AdaLomo.

    from lomo_kernels.integrations.hf_trainer import LomoTrainer
    args = TrainingArguments(..., optim="lomo", learning_rate=1e-3, weight_decay=0.01,
                             max_grad_norm=1.0)
    LomoTrainer(model=model, args=args, train_dataset=ds).train()

`optim="adalomo"` selects AdaLomo. Unlike `Trainer(optim="lomo")` with lomo-optim, weight
decay (on the parameters transformers decays: not on norm weights and biases) and
`max_grad_norm` reach the optimizer, the scheduler's learning rate is used every step, the
logged `grad_norm` is the step's gradient norm before clipping, fp16 weights work, and
`gradient_accumulation_steps=k` accumulates k micro-batches into the optimizer's buffers
(``accumulation_steps=k``; an epoch's last, shorter step applied at its last micro-batch).
A `Lomo`/`AdaLomo` passed through `optimizers=(opt, scheduler)` is used as given (in one
process; under DeepSpeed the optimizer is built on the engine).

Clipping: exact by default (`max_grad_norm > 0` runs a norm pass, so two backward passes per
step, as lomo-optim); `optim_args="single_backward=True"` clips within one backward
(see trainer_optimizer.py for the trade-off).

Multi-process: `TrainingArguments(deepspeed=<ZeRO stage 3 config>)` under torchrun. accelerate
builds the engine without an optimizer (ZeRO-3 partitions the parameters), the optimizer is
built on the engine right after, and each step forwards through the module itself (the
engine's forward would install DeepSpeed's own backward hooks). A step with a norm pass runs
its own forward for it: DeepSpeed releases the gathered parameters after the first backward.
Checkpoints hold both kinds of state. The consolidated (unsharded) model and optimizer state,
written by rank 0: `save_model` and the Trainer's periodic checkpoints load in one process as
any other, and `LomoTrainer(...).train(resume_from_checkpoint=...)` without DeepSpeed
continues from them. And the engine's sharded checkpoint (``global_step<N>/`` and
``latest``: each rank's partitions and its part of the optimizer state, see
lomo_kernels.checkpoint), through which transformers resumes under DeepSpeed:
`train(resume_from_checkpoint=...)` in the same sharded set-up, with the schedule, data
order and RNG states continuing as transformers restores them. `resume_from_checkpoint=True`
takes the newest whole checkpoint (trainer_checkpoints.py), not merely the newest.
What is refused is listed in trainer_parallel.py.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from ..distributed import consolidated_state_dict
from ..optim._in_backward import InBackwardOptimizer
from .huggingface import (
    check_training_arguments,
    drop_interrupted_step,
    in_backward_optimizer,
    report_skipped_step,
)
from .trainer_checkpoints import last_whole_checkpoint
from .trainer_optimizer import optimizer_class, optimizer_kwargs
from .trainer_parallel import check_deepspeed_config, check_parallel_setup, deepspeed_config


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
            config = deepspeed_config(targs)
            if config is not None:
                check_deepspeed_config(config)
        super().__init__(*args, **kwargs)
        check_parallel_setup(self)
        targs = self.args
        given = self.optimizer
        if given is not None and not isinstance(given, InBackwardOptimizer):
            raise TypeError(
                f"LomoTrainer trains with lomo_kernels.Lomo or AdaLomo, got {type(given).__name__}"
            )
        steps = targs.gradient_accumulation_steps
        if given is not None and given.accumulation_steps != steps:
            raise ValueError(
                f"TrainingArguments(gradient_accumulation_steps={steps}) but the given optimizer "
                f"was built with accumulation_steps={given.accumulation_steps}: build it with "
                "the same number of micro-batches per step"
            )
        # Clipping happens inside the optimizer (it needs the norm before any update); the
        # Trainer's own clipping would only see freed gradients.
        self.lomo_max_grad_norm = targs.max_grad_norm
        targs.max_grad_norm = 0.0

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:  # the newest whole checkpoint, not the newest
            found = last_whole_checkpoint(self.args.output_dir, self.is_deepspeed_enabled)
            if found is None:
                raise ValueError(
                    f"resume_from_checkpoint=True: no whole checkpoint in {self.args.output_dir}"
                )
            resume_from_checkpoint = found
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _engine(self) -> torch.nn.Module | None:
        """The DeepSpeed engine accelerate built, or None (before that, or without one)."""
        wrapped = self.accelerator.deepspeed_engine_wrapped
        return None if wrapped is None else wrapped.engine

    def create_optimizer(self, model: torch.nn.Module | None = None) -> InBackwardOptimizer | None:
        if self.optimizer is None:
            if self.is_deepspeed_enabled:
                # transformers would hand an optimizer to deepspeed.initialize: build none
                # until accelerate made the engine (create_scheduler, right after), then
                # build it on the engine, whose module holds the ZeRO-3 partitions.
                model = self._engine()
                if model is None:
                    return None
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
        elif (given := in_backward_optimizer(self.optimizer)) is not None:
            drop_interrupted_step(given)  # a run starts: nothing of an interrupted one's step
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        if optimizer is None and self.optimizer is None:
            self.create_optimizer()  # under DeepSpeed: the engine exists by now
        return super().create_scheduler(num_training_steps, optimizer)

    def _lomo(self) -> InBackwardOptimizer:
        return in_backward_optimizer(self.optimizer)  # accelerate wraps the optimizer

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        opt = self._lomo()
        if self.is_deepspeed_enabled:
            # The module itself: the engine's forward would hook DeepSpeed's backward in.
            model = self.accelerator.unwrap_model(model)
            if opt._needs_norm_pass():
                # ZeRO-3 releases the gathered parameters after a backward: the norm pass
                # needs a forward of its own.
                opt.grad_norm(self._loss(model, inputs, num_items_in_batch))
        loss = self._loss(model, inputs, num_items_in_batch)
        if not self._loss_scaled_for_accumulation(num_items_in_batch):
            loss = loss / self.current_gradient_accumulation_steps  # as Trainer.training_step
        # The learning rate comes from the param groups, which the scheduler sets.
        opt._fused_backward_in_loop(loss, None, self.accelerator.sync_gradients)
        if self.accelerator.sync_gradients:
            report_skipped_step(self.accelerator, opt)
        return loss.detach()

    def _loss_scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """Whether the loss is already a share of the whole step's (divided by the step's
        item count, by the model or by compute_loss_func), as Trainer.training_step decides."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return scaled
        accepts = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        return accepts or self.compute_loss_func is not None

    def _loss(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any
    ) -> torch.Tensor:
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return loss.mean() if self.args.n_gpu > 1 else loss

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        # The Trainer would measure the freed gradients (0.0): log the norm the step measured
        # before clipping, or nothing when it measured none (no clipping, not fp16).
        return self._lomo().last_grad_norm

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self.is_deepspeed_enabled:
            return super().save_model(output_dir, _internal_call)
        # The ZeRO-3 partitions gathered whole (a collective: every rank takes part; rank 0
        # writes), instead of DeepSpeed's engine checkpoint, which needs a ZeRO optimizer.
        state = consolidated_state_dict(self.model)
        self._save(self.args.output_dir if output_dir is None else output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.is_deepspeed_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        # The sharded checkpoint transformers resumes from under DeepSpeed (the engine's
        # save_checkpoint, served by the optimizer: each rank its own shards, `latest`
        # written once all are whole), and the consolidated optimizer state a one-process
        # resume reads (AdaLomo's 1-D moments gathered; the rest is whole on every rank).
        self.model_wrapped.save_checkpoint(output_dir)
        state = self._lomo().consolidated_state_dict()  # a collective, as above
        if self.args.should_save:
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
