"""One rank of the multi-process Trainer checks (run by test_trainer_sharded.py under
torchrun, gloo, CPU).

- LomoTrainer with TrainingArguments(deepspeed=<ZeRO-3 config>), each run of `RUNS`;
- what accelerate's FSDP2 plugin would run, written by hand (accelerate enables the plugin on
  GPU ranks only): fully_shard on each decoder layer and the root, Lomo/AdaLomo with the param
  groups LomoTrainer builds from the same TrainingArguments, transformers' linear schedule,
  `fused_backward` per step, on the batches the ZeRO-3 Trainer gave this rank;
- a ZeRO-3 LomoTrainer run resumed from its sharded step-2 checkpoint by a new trainer, and
  a resume from a copy of it whose rank-1 client_state runs code as it is unpickled;
- the set-ups LomoTrainer refuses.

Writes, on rank 0, to the directory in argv[1]: for each run the initial and consolidated
final parameters and the order the gradients were consumed in; a checkpoint of the Lomo and
AdaLomo Trainer runs; and `checks.json` with what every rank observed (backward passes per
step, logged norms, the refusals).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState
from torch.distributed.fsdp import fully_shard
from transformers import Trainer, get_scheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.crafted import RunsCode, plant_client_state  # noqa: E402
from support.sharded_checks import count_phases, record_order, write_checks  # noqa: E402
from support.state import assert_same_state  # noqa: E402
from support.trainer_runs import (  # noqa: E402
    ACCUMULATE,
    EVAL,
    EVAL_ROWS,
    PER_RANK_BATCH,
    RUNS,
    STEPS,
    ZERO3,
    dataset,
    llama,
    logged,
    logged_norms,
    training_args,
)

from lomo_kernels import Lomo  # noqa: E402
from lomo_kernels.distributed import consolidated_state_dict  # noqa: E402
from lomo_kernels.integrations.hf_trainer import LomoTrainer  # noqa: E402
from lomo_kernels.integrations.trainer_optimizer import (  # noqa: E402
    optimizer_class,
    optimizer_kwargs,
)

torch.set_num_threads(1)
OUT = Path(sys.argv[1])


class ObservedTrainer(LomoTrainer):
    """Records the optimizer's backward passes, the order it consumes the gradients in and
    the input ids of each step."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.batches = getattr(self, "batches", [])
        self.batches.append(inputs["input_ids"].clone())
        self.lrs = getattr(self, "lrs", [])
        self.lrs.append(self._lomo().param_groups[0]["lr"])  # the one this step applies
        return super().training_step(model, inputs, num_items_in_batch)

    def create_optimizer(self, model=None):
        fresh = self.optimizer is None
        opt = super().create_optimizer(model)
        if fresh and opt is not None:
            self.phases = count_phases(opt)
            self.order = record_order(opt, self.model)
        return opt


def run(name: str, rank: int, checks: dict) -> list[torch.Tensor]:
    """One LomoTrainer run under ZeRO-3; returns this rank's batches."""
    model = llama()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    exact = name in ("lomo", "adalomo")
    extra = {"save_strategy": "steps", "save_steps": STEPS, **EVAL} if exact else {}
    if name.endswith("accumulate"):
        extra = ACCUMULATE
    args = training_args(
        str(OUT / name),
        name,
        deepspeed=ZERO3,
        per_device_eval_batch_size=PER_RANK_BATCH,
        **extra,
        **configured_state(),
    )
    trainer = ObservedTrainer(
        model=model,
        args=args,
        train_dataset=dataset(),
        eval_dataset=dataset(EVAL_ROWS) if exact else None,
    )
    trainer.train()
    opt = trainer._lomo()
    final = consolidated_state_dict(trainer.model)
    checks[name] = {
        "phases": trainer.phases,
        "norms": logged_norms(trainer),
        "eval_losses": logged(trainer, "eval_loss"),
        "sharded": type(opt._sharding).__name__,
        "partitioned": sum(p.ds_tensor.numel() < p.ds_numel for p in trainer.model.parameters()),
        "persistent": sum(bool(p.ds_persist) for p in trainer.model.parameters()),
        "steps": opt.step_count,
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, trainer.batches)
    if rank == 0:
        saved = {"initial": initial, "final": final, "order": trainer.order, "batches": everyone}
        torch.save(saved, OUT / f"{name}.pt")
    return trainer.batches


def run_fsdp2(name: str, batches: list[torch.Tensor], rank: int, checks: dict) -> None:
    """The FSDP2 plugin's set-up by hand, trained as LomoTrainer trains (module docstring)."""
    model = llama()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    for layer in model.model.layers:  # transformer_layer_cls_to_wrap: LlamaDecoderLayer
        fully_shard(layer)
    fully_shard(model)
    args = training_args(str(OUT / f"fsdp2_{name}"), name)
    decay = Trainer.get_decay_parameter_names(None, model)
    kwargs = optimizer_kwargs(args, model, decay, max_grad_norm=args.max_grad_norm)
    opt = optimizer_class(args.optim)(model, **kwargs)
    schedule = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=STEPS)
    phases, norms = count_phases(opt), []
    for x in batches:
        opt.fused_backward(model(input_ids=x, labels=x).loss)
        norms.append(float(opt.last_grad_norm))
        schedule.step()
    opt.flush_report()
    final = consolidated_state_dict(model)
    checks[f"fsdp2_{name}"] = {"phases": phases, "norms": norms, "steps": len(batches)}
    if rank == 0:
        torch.save({"initial": initial, "final": final}, OUT / f"fsdp2_{name}.pt")


RESUME_STEPS, RESUME_SAVE = 4, 2


def run_resumed(rank: int, checks: dict) -> None:
    """AdaLomo (exact clipping) for 4 steps with a checkpoint every 2; then a new trainer in
    the same ranks resumes from the step-2 checkpoint and trains to step 4."""
    directory = OUT / "resume"
    runs = {}
    for label, resume in (("uninterrupted", None), ("resumed", f"checkpoint-{RESUME_SAVE}")):
        args = training_args(
            str(directory),
            "adalomo",
            deepspeed=ZERO3,
            max_steps=RESUME_STEPS,
            save_strategy="steps",
            save_steps=RESUME_SAVE,
            **configured_state(),
        )
        trainer = ObservedTrainer(model=llama(seed=1), args=args, train_dataset=dataset())
        trainer.train(resume_from_checkpoint=None if resume is None else str(directory / resume))
        opt = trainer._lomo()
        runs[label] = {
            "final": consolidated_state_dict(trainer.model),
            "opt": opt.consolidated_state_dict(),
            "step_count": opt.step_count,
            "lrs": trainer.lrs,
            "logged_lrs": logged(trainer, "learning_rate"),
            "batches": [b.tolist() for b in trainer.batches],
        }
    checks["resume"] = {
        label: {k: v for k, v in run.items() if k not in ("final", "opt")}
        for label, run in runs.items()
    }
    if rank == 0:
        torch.save(runs, OUT / "resume.pt")


class LoadWatchingTrainer(LomoTrainer):
    """Records the consolidated model and optimizer state right before a resume loads (the
    scheduler is made after the engine and its optimizer, before the checkpoint is read)."""

    def create_scheduler(self, num_training_steps, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        self.before_load = consolidated(self)
        return scheduler


def consolidated(trainer: LomoTrainer) -> dict:
    return {
        "model": consolidated_state_dict(trainer.model),
        "opt": trainer._lomo().consolidated_state_dict(),
    }


def run_resume_running_code(rank: int, checks: dict) -> None:
    """train(resume_from_checkpoint=...) from a copy of the step-2 checkpoint whose rank-1
    client_state runs code as it is unpickled (its manifest re-recorded): refused on every
    rank, naming the file, with the code never run and nothing changed."""
    crafted = OUT / "crafted" / f"checkpoint-{RESUME_SAVE}"
    if rank == 0:
        shutil.copytree(OUT / "resume" / f"checkpoint-{RESUME_SAVE}", crafted)
        record = {"client_state": {}, "payload": RunsCode(OUT / "code-ran")}
        plant_client_state(crafted / f"global_step{RESUME_SAVE}", 1, record)
    dist.barrier()
    args = training_args(
        str(OUT / "crafted"),
        "adalomo",
        deepspeed=ZERO3,
        max_steps=RESUME_STEPS,
        **configured_state(),
    )
    trainer = LoadWatchingTrainer(model=llama(seed=1), args=args, train_dataset=dataset())
    checks["resume_runs_code"] = refusal(lambda: trainer.train(resume_from_checkpoint=str(crafted)))
    try:
        assert_same_state(consolidated(trainer), trainer.before_load)
        checks["resume_runs_code_unchanged"] = True
    except AssertionError as difference:
        checks["resume_runs_code_unchanged"] = str(difference)


def refusal(build) -> str | None:
    try:
        build()
    except ValueError as exc:
        return str(exc)
    return None


def run_refusals(checks: dict) -> None:
    """Set-ups refused at construction or at train(), before any parameter changes."""
    model = llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = dataset()

    def trainer(config=ZERO3, **overrides):
        if config is not None and "accelerator_config" not in overrides:
            overrides |= configured_state()
        args = training_args(str(OUT / "refused"), "lomo", deepspeed=config, **overrides)
        return LomoTrainer(model=model, args=args, train_dataset=data)

    def given_optimizer():
        own = llama()  # hooked by the given optimizer: not the model checked afterwards
        opt = Lomo(own, lr=0.1, replicated=False)  # whole on each rank: say so
        args = training_args(str(OUT / "refused"), "lomo", deepspeed=ZERO3, **configured_state())
        LomoTrainer(model=own, args=args, train_dataset=data, optimizers=(opt, None))

    zero = ZERO3["zero_optimization"]
    offload = {"device": "cpu"}
    refused = {
        "stage2": refusal(lambda: trainer({**ZERO3, "zero_optimization": {"stage": 2}})),
        "optimizer_block": refusal(
            lambda: trainer({**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
        ),
        "scheduler_block": refusal(lambda: trainer({**ZERO3, "scheduler": {"type": "WarmupLR"}})),
        "offload_param": refusal(
            lambda: trainer({**ZERO3, "zero_optimization": {**zero, "offload_param": offload}})
        ),
        "given_optimizer": refusal(given_optimizer),
        # TrainingArguments' own set-up of accelerate's state: one process counted.
        "process_count": refusal(lambda: trainer(accelerator_config={})),
    }
    # accelerate's DeepSpeed plugin leaves ACCELERATE_USE_DEEPSPEED set for the process; a
    # fresh process without DeepSpeed has none. Without DeepSpeed, accelerate runs CPU ranks
    # as MULTI_CPU: it replicates the model (DDP) and drops an FSDP plugin.
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    refused |= {
        "ddp": refusal(lambda: trainer(config=None, use_cpu=True)),
        "fsdp2_plugin": refusal(
            lambda: trainer(
                config=None,
                use_cpu=True,
                fsdp="full_shard",
                fsdp_config={
                    "fsdp_version": 2,
                    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                },
            )
        ),
    }
    after = model.state_dict()
    checks["refusals"] = refused
    checks["refusals_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)


class SkipRecordingTrainer(LomoTrainer):
    """Records each step's lr and whether the optimizer skipped it; the fp16 loss scale
    starts too high (2^21), so the first steps overflow."""

    def create_optimizer(self, model=None):
        fresh = self.optimizer is None
        opt = super().create_optimizer(model)
        if fresh and opt is not None:
            opt.loss_scaler.cur_scale = 2.0**21
        return opt

    def training_step(self, model, inputs, num_items_in_batch=None):
        lomo = self._lomo()
        lr = lomo.param_groups[0]["lr"]
        loss = super().training_step(model, inputs, num_items_in_batch)
        lomo.flush_report()  # the step's outcome now, not at the next call
        self.steps = [*getattr(self, "steps", []), (lr, lomo.last_step_skipped)]
        return loss


def run_fp16_schedule(checks: dict) -> None:
    """fp16 weights under ZeRO-3, where accelerate prepared the engine before the optimizer
    existed: the steps the dynamic loss scaler skips must hold the lr schedule."""
    args = training_args(
        str(OUT / "fp16_schedule"), "lomo", deepspeed=ZERO3, warmup_steps=4, max_steps=8,
        learning_rate=0.01, weight_decay=0.0, **configured_state(),
    )  # fmt: skip
    trainer = SkipRecordingTrainer(model=llama().half(), args=args, train_dataset=dataset(64))
    trainer.train()
    checks["fp16_schedule"] = trainer.steps


def configured_state() -> dict:
    """accelerate's state for DeepSpeed on CPU ranks: without a backend name accelerate
    counts one process (trainer_parallel.py); the Trainer uses this state as configured."""
    # A fresh state per Trainer, as TrainingArguments makes one when it sets it up itself.
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return {"accelerator_config": {"use_configured_state": True}}


def main() -> None:
    checks: dict = {}
    rank = int(os.environ["RANK"])
    batches = {name: run(name, rank, checks) for name in RUNS}
    for name in ("lomo", "adalomo"):
        run_fsdp2(name, batches[name], rank, checks)
    run_resumed(rank, checks)
    run_resume_running_code(rank, checks)
    run_refusals(checks)
    run_fp16_schedule(checks)
    write_checks(OUT, checks)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
