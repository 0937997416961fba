"""Which multi-process Trainer set-ups LomoTrainer serves, checked before anything changes.

Served: one process, and DeepSpeed ZeRO-3 through ``TrainingArguments(deepspeed=<config>)``.
Under DeepSpeed, transformers would pass its optimizer to ``deepspeed.initialize``, whose ZeRO-3
optimizer would then reduce and keep the gradients itself; LomoTrainer instead lets accelerate
build the engine with no optimizer (ZeRO-3 only partitions the parameters, as in the plain
loop) and builds Lomo/AdaLomo on the engine afterwards (`hf_trainer.py`).

Refused, each with what to do instead:

- a DeepSpeed config that is not ZeRO stage 3, or that sets ``optimizer`` or ``scheduler``
  (Lomo/AdaLomo is the optimizer, the Trainer's arguments give the schedule), or parameter /
  optimizer offload;
- ``TrainingArguments(fsdp=...)`` where accelerate did not switch its FSDP plugin on
  (accelerate enables it only for GPU-type processes; see `FSDP_NOT_ENABLED`), and the plugin
  where it is on (`FSDP_PLUGIN`);
- other multi-process runs (DDP): every rank would hold whole parameters and apply its own
  unreduced gradient;
- under DeepSpeed, ``optimizers=(...)`` (transformers drops them there; the optimizer can only
  be built on the engine);
- a DeepSpeed run whose ranks accelerate does not count (CPU processes, unless accelerate's
  state was set up with a backend first): every rank would train on the same batches.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from accelerate.utils.deepspeed import HfDeepSpeedConfig
from transformers import TrainingArguments

PLAIN_LOOP = (
    "train in a plain loop (README, 'Sharded training'; examples/zero3_finetune.py, "
    "examples/fsdp2_finetune.py)"
)

# accelerate (1.15: accelerate/state.py, AcceleratorState.__init__) sets distributed_type to
# FSDP only inside `elif self.distributed_type in [MULTI_GPU, MULTI_MLU, ..., MULTI_NEURON]`;
# processes on CPU are MULTI_CPU there, so the plugin is dropped.
FSDP_NOT_ENABLED = (
    "TrainingArguments(fsdp=...) is set but accelerate did not enable FSDP: accelerate "
    "switches its FSDP plugin on only for processes with a GPU-type device (MULTI_GPU, "
    "MULTI_XPU, ...; never MULTI_CPU), so on CPU ranks the model would stay whole on every "
    "rank. Run on GPUs, or shard the model yourself with fully_shard and train it with "
    "Lomo/AdaLomo in a plain loop (README, 'Sharded training (FSDP2)')"
)

# Where the plugin is on (GPU ranks): Accelerator.prepare takes the model and the optimizer
# together under FSDP2 and swaps the optimizer's parameters for the sharded ones
# (fsdp2_switch_optimizer_parameters); Lomo/AdaLomo hook and index their parameters when they
# are built, so they would keep serving the unsharded ones.
FSDP_PLUGIN = (
    "accelerate's FSDP plugin is not served by LomoTrainer: accelerate's prepare shards the "
    "model after the optimizer was built and swaps the optimizer's parameters, while "
    "Lomo/AdaLomo hook the parameters they were built on. Use DeepSpeed ZeRO-3 "
    "(TrainingArguments(deepspeed=...)), or apply fully_shard yourself and " + PLAIN_LOOP
)


def deepspeed_config(args: TrainingArguments) -> dict[str, Any] | None:
    """The DeepSpeed config the Trainer will use (file already read), or None without one."""
    if not getattr(args, "deepspeed", None):
        return None
    # TrainingArguments reads it at construction; one assigned later (a dict, a file's path)
    # is read here without registering it process-wide.
    hf_config = getattr(args, "hf_deepspeed_config", None) or HfDeepSpeedConfig(args.deepspeed)
    return hf_config.config


def _offloaded(zero: dict[str, Any], key: str) -> bool:
    device = (zero.get(key) or {}).get("device", "none")
    return str(device).lower() not in ("none", "")


def check_deepspeed_config(config: dict[str, Any]) -> None:
    """Refuses a DeepSpeed config LOMO cannot train under (module docstring)."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage != 3:
        raise ValueError(
            f"the DeepSpeed config sets zero_optimization.stage={stage}: LomoTrainer needs "
            "stage 3 (parameters partitioned, gradients reduced by Lomo/AdaLomo's own hooks). "
            "Set zero_optimization.stage to 3"
        )
    for block, instead in (
        ("optimizer", "TrainingArguments(optim='lomo' or 'adalomo') chooses the optimizer"),
        (
            "scheduler",
            "TrainingArguments(lr_scheduler_type=..., warmup_steps=...) sets the schedule",
        ),
    ):
        if block in config:
            raise ValueError(
                f"the DeepSpeed config sets {block!r}: LOMO updates the parameters inside "
                f"backward, so DeepSpeed must not build its own {block}. Remove {block!r}; "
                + instead
            )
    for key, what in (
        ("offload_param", "the partitions would live off the device the gradients arrive on"),
        ("offload_optimizer", "there is no DeepSpeed optimizer state to offload"),
    ):
        if _offloaded(zero, key):
            raise ValueError(
                f"the DeepSpeed config sets zero_optimization.{key}: {what}. Remove {key} "
                "(LOMO keeps no gradients or optimizer state beyond AdaLomo's factored moments)"
            )


def check_parallel_setup(trainer: Any) -> None:
    """Refuses the multi-process set-ups LomoTrainer does not serve (module docstring);
    called at the end of LomoTrainer's construction, before any parameter changes."""
    args = trainer.args
    if trainer.is_deepspeed_enabled:
        # The config the engine will use: also set where TrainingArguments has none (an
        # Accelerator built with a DeepSpeed plugin earlier in the process turns it on).
        check_deepspeed_config(trainer.accelerator.state.deepspeed_plugin.deepspeed_config)
        _check_process_count(trainer.accelerator.num_processes)
        if trainer.optimizer is not None or trainer.lr_scheduler is not None:
            # transformers' DeepSpeed set-up drops them (deepspeed_init starts from None).
            raise ValueError(
                "optimizers=(...) under DeepSpeed: LomoTrainer builds Lomo/AdaLomo on the "
                "ZeRO-3 engine, which exists only once training starts, and transformers "
                "discards a given optimizer and scheduler there. Pass none; set optim, "
                "learning_rate, weight_decay, max_grad_norm, optim_args and lr_scheduler_type "
                "in TrainingArguments"
            )
        return
    if args.fsdp and not trainer.is_fsdp_enabled:
        raise ValueError(FSDP_NOT_ENABLED)
    if trainer.is_fsdp_enabled:
        raise ValueError(FSDP_PLUGIN)
    processes = trainer.accelerator.num_processes
    if dist.is_available() and dist.is_initialized():
        processes = max(processes, dist.get_world_size())
    if processes > 1:
        raise ValueError(
            f"{processes} processes without DeepSpeed ZeRO-3: accelerate "
            "would replicate the model (DDP) and each rank would apply its own unreduced "
            "gradient inside backward. Pass TrainingArguments(deepspeed=<a ZeRO stage 3 "
            "config>), or " + PLAIN_LOOP
        )


def _check_process_count(counted: int) -> None:
    """Refuses DeepSpeed runs whose ranks accelerate does not count (CPU processes)."""
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if counted != ranks:
        # accelerate/state.py, PartialState.__init__: DeepSpeed on processes without a GPU-type
        # device gets no backend name, and "No backend == no distributed training" sets
        # num_processes = 1 while DeepSpeed started every rank: the data would not be split.
        raise ValueError(
            f"accelerate counts {counted} process(es) but torch.distributed runs {ranks} ranks: "
            "under DeepSpeed on CPU processes accelerate names no backend and treats the run "
            "as one process, so every rank would train on the same batches. Set up accelerate's "
            "state first: os.environ['ACCELERATE_USE_DEEPSPEED'] = 'true'; "
            "accelerate.PartialState(backend='gloo'), and pass TrainingArguments(..., "
            "accelerator_config={'use_configured_state': True})"
        )
