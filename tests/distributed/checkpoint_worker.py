"""One rank of the sharded checkpoint checks (run by test_sharded_checkpoint.py under
torchrun, gloo, CPU).

    checkpoint_worker.py OUT reference ONE_PROCESS_CKPT
        Per engine (FSDP2, ZeRO-3) and optimizer set-up: trains STEPS steps with a checkpoint
        after SAVE_AT, and writes the consolidated state at SAVE_AT and at the end; then, in
        the same processes, fresh objects resume from the checkpoint and finish. Loads the
        one-process checkpoint ONE_PROCESS_CKPT into FSDP2 (1 -> 2), and tries loading a
        checkpoint of another optimizer class, and one whose rank-1 client_state runs code
        as it is unpickled, on every rank; saves a client_state only rank 1's part of which
        a load would refuse.
        Also saves and resumes FSDP2 through torch's own get_state_dict / dcp.save /
        dcp.load / set_state_dict.
    checkpoint_worker.py OUT zero3-one-rank REFERENCE_OUT   (1 rank)
        Loads the reference run's 2-rank ZeRO-3 checkpoint on one rank.
    checkpoint_worker.py OUT killed
        Trains to SAVE_AT and checkpoints under both engines, then rank 1 kills itself
        (SIGKILL) in the middle of the next backward.
    checkpoint_worker.py OUT resumed KILLED_OUT
        Fresh processes resume the killed run's checkpoints (in KILLED_OUT) and finish.
    checkpoint_worker.py OUT dies-saving
        Rank 1 kills itself (SIGKILL) while the checkpoint is being written.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.crafted import RunsCode, plant_client_state, rerecord_manifest  # noqa: E402
from support.sharded_checks import run_worker  # noqa: E402
from support.sharded_models import LR, OPTIONS, SINGLE, ScaledLlama, rank_batch  # noqa: E402
from support.state import assert_same_state, changes_since, optimizer_snapshot  # noqa: E402

import lomo_kernels  # noqa: E402
from lomo_kernels import AdaLomo, Lomo  # noqa: E402
from lomo_kernels.distributed import consolidated_state_dict  # noqa: E402

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
MODE = sys.argv[2]
STEPS, SAVE_AT = 4, 2
# (optimizer class, its options): two passes with clipping; one backward with the norm
# history and AdaLomo's moments (a 1-D parameter's sliced like the parameter).
SETUPS = {
    "lomo": (Lomo, {"lr": LR["lomo"], **OPTIONS}),
    "adalomo_single": (AdaLomo, {"lr": LR["adalomo"], **SINGLE}),
}
ZERO3_CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}


def build(engine: str, setup: str):
    """(the model as the optimizer and the checkpoint take it, the optimizer), the same
    initial values on every rank and in every run."""
    cls, options = SETUPS[setup]
    torch.manual_seed(0)
    if engine == "fsdp2":
        model = ScaledLlama()
        for layer in model.llama.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
            module = ScaledLlama()
        model, *_ = deepspeed.initialize(model=module, config=ZERO3_CONFIG)
    return model, cls(model, **options)


def forward(model, engine: str, step: int) -> torch.Tensor:
    module = model.module if engine == "zero3" else model
    return module(rank_batch(step, dist.get_rank()))


def train_step(model, opt, engine: str, step: int) -> None:
    if opt.clip_grad_norm is not None and not opt.single_backward:
        opt.grad_norm(forward(model, engine, step))
    opt.fused_backward(forward(model, engine, step))


def save(model, opt, engine: str, directory: Path, step: int) -> None:
    if engine == "zero3":  # DeepSpeed's own call, as a DeepSpeed loop makes it
        model.save_checkpoint(directory, client_state={"step": step})
    else:
        lomo_kernels.save_checkpoint(directory, model, opt, client_state={"step": step})


def load(model, opt, engine: str, directory: Path) -> int:
    """Loads the checkpoint; returns the step to continue from."""
    if engine == "zero3":
        path, client_state = model.load_checkpoint(directory)
        assert path is not None, f"no 'latest' in {directory}"
    else:
        client_state = lomo_kernels.load_checkpoint(directory, model, opt)
    return client_state["step"]


def consolidated(model, opt) -> dict:
    return {"model": consolidated_state_dict(model), "opt": opt.consolidated_state_dict()}


def dump(name: str, state: dict) -> None:
    if dist.get_rank() == 0:
        torch.save(state, OUT / f"{name}.pt")


def finish(model, opt, engine: str, start: int) -> None:
    for step in range(start, STEPS):
        train_step(model, opt, engine, step)
    opt.flush_report()


def reference(checks: dict, one_process_ckpt: Path) -> None:
    for engine in ("fsdp2", "zero3"):
        for setup in SETUPS:
            tag = f"{engine}_{setup}"
            model, opt = build(engine, setup)
            for step in range(SAVE_AT):
                train_step(model, opt, engine, step)
            save(model, opt, engine, OUT / tag, SAVE_AT)
            dump(f"{tag}_at_save", consolidated(model, opt))
            finish(model, opt, engine, SAVE_AT)
            dump(f"{tag}_final", consolidated(model, opt))
            opt.detach()
            if engine == "zero3":  # the engine's own methods are back
                checks[f"{tag}_restored"] = not {"save_checkpoint", "load_checkpoint"} & set(
                    vars(model)
                )
            resumed, resumed_opt = build(engine, setup)
            start = load(resumed, resumed_opt, engine, OUT / tag)
            finish(resumed, resumed_opt, engine, start)
            dump(f"{tag}_resumed_final", consolidated(resumed, resumed_opt))
            resumed_opt.detach()
    torch_api(checks)
    # 1 -> 2: a one-process checkpoint into FSDP2.
    model, opt = build("fsdp2", "adalomo_single")
    checks["one_process_step"] = lomo_kernels.load_checkpoint(one_process_ckpt, model, opt)
    dump("from_one_process", consolidated(model, opt))
    opt.detach()
    refused_on_one_rank(checks)
    # Runs code as it is unpickled; is no torch.save file at all (a truncated zip).
    runs_code = {"step": SAVE_AT, "payload": RunsCode(OUT / "code-ran")}
    client_state_refused_on_every_rank(checks, "runs_code", runs_code)
    client_state_refused_on_every_rank(checks, "not_torch", b"PK\x03\x04truncated")
    unloadable_save_refused_on_every_rank(checks)
    # Another optimizer class's checkpoint: refused on every rank, nothing changed.
    model, opt = build("fsdp2", "lomo")
    before = optimizer_snapshot(model, opt)
    try:
        lomo_kernels.load_checkpoint(OUT / "fsdp2_adalomo_single", model, opt)
        checks["other_class"] = None
    except ValueError as error:
        checks["other_class"] = str(error)
    checks["other_class_changed"] = changes_since(before, model, opt)
    # The one-process checkpoint (parameters whole) under ZeRO-3 (flat partitions): refused,
    # saying where it does load, nothing changed.
    model, opt = build("zero3", "adalomo_single")
    before = optimizer_snapshot(model.module, opt)
    try:
        lomo_kernels.load_checkpoint(one_process_ckpt, model, opt)
        checks["whole_into_zero3"] = None
    except ValueError as error:
        checks["whole_into_zero3"] = str(error)
    checks["whole_into_zero3_changed"] = changes_since(before, model.module, opt)


def refused_on_one_rank(checks: dict) -> None:
    """A checkpoint whose only bad value (a NaN moment) is in rank 1's slice: every rank
    refuses it, and rank 0, whose own part passes every check, changes nothing either."""
    model, opt = build("fsdp2", "adalomo_single")
    train_step(model, opt, "fsdp2", 0)
    norm = model.llama.model.norm.weight  # 40 elements: 20 on each rank
    if dist.get_rank() == 1:
        opt.state[norm]["exp_avg_sq"][0] = float("nan")
    lomo_kernels.save_checkpoint(OUT / "nan_on_rank1", model, opt)
    opt.detach()
    fresh, fresh_opt = build("fsdp2", "adalomo_single")
    before = optimizer_snapshot(fresh, fresh_opt)
    try:
        lomo_kernels.load_checkpoint(OUT / "nan_on_rank1", fresh, fresh_opt)
        checks["nan_on_rank1"] = None
    except ValueError as error:
        checks["nan_on_rank1"] = str(error)
    checks["nan_on_rank1_changed"] = changes_since(before, fresh, fresh_opt)
    fresh_opt.detach()


def client_state_refused_on_every_rank(checks: dict, name: str, planted: object) -> None:
    """A copy of the FSDP2 checkpoint whose rank-1 client_state is `planted` (an object
    torch.save writes, or raw bytes; the manifest re-recorded): every rank refuses it alike,
    naming the file, with the model and optimizer unchanged bit for bit (`checks[name]`,
    `checks[name + "_unchanged"]`)."""
    crafted = OUT / f"crafted_{name}"
    if dist.get_rank() == 0:
        shutil.copytree(OUT / "fsdp2_adalomo_single", crafted)
        if isinstance(planted, bytes):
            (crafted / "client_state_1.pt").write_bytes(planted)
            rerecord_manifest(crafted)
        else:
            plant_client_state(crafted, 1, planted)
    dist.barrier()
    model, opt = build("fsdp2", "adalomo_single")
    train_step(model, opt, "fsdp2", 0)  # moments, a step count: state that could change
    before = consolidated(model, opt)
    try:
        lomo_kernels.load_checkpoint(crafted, model, opt)
        checks[name] = None
    except ValueError as error:
        checks[name] = str(error)
    try:
        assert_same_state(consolidated(model, opt), before)
        checks[f"{name}_unchanged"] = True
    except AssertionError as difference:
        checks[f"{name}_unchanged"] = str(difference)
    opt.detach()


def unloadable_save_refused_on_every_rank(checks: dict) -> None:
    """Rank 1's client_state holds a lambda: every rank refuses the save before anything is
    written."""
    model, opt = build("fsdp2", "lomo")
    own = {"step": 1, "schedule": lambda step: 0.5} if dist.get_rank() == 1 else {"step": 1}
    try:
        lomo_kernels.save_checkpoint(OUT / "unloadable", model, opt, client_state=own)
        checks["unloadable_save"] = None
    except ValueError as error:
        checks["unloadable_save"] = str(error)
    opt.detach()


def torch_api(checks: dict) -> None:
    """FSDP2 AdaLomo saved at step 2 and resumed by fresh objects through torch's own API."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = build("fsdp2", "adalomo_single")
    for step in range(SAVE_AT):
        train_step(model, opt, "fsdp2", step)
    model_state, opt_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=OUT / "torch_api")
    opt.detach()
    model, opt = build("fsdp2", "adalomo_single")
    model_state, opt_state = get_state_dict(model, opt)
    dcp.load({"model": model_state, "optim": opt_state}, checkpoint_id=OUT / "torch_api")
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=opt_state)
    checks["torch_api_step"] = opt.step_count
    finish(model, opt, "fsdp2", SAVE_AT)
    dump("fsdp2_torch_api_final", consolidated(model, opt))
    opt.detach()


def zero3_one_rank(checks: dict, reference_out: Path) -> None:
    model, opt = build("zero3", "adalomo_single")
    checks["step"] = load(model, opt, "zero3", reference_out / "zero3_adalomo_single")
    dump("zero3_on_one_rank", consolidated(model, opt))


def killed() -> None:
    runs = {engine: build(engine, "adalomo_single") for engine in ("zero3", "fsdp2")}
    for engine, (model, opt) in runs.items():
        for step in range(SAVE_AT):
            train_step(model, opt, engine, step)
        save(model, opt, engine, OUT / f"{engine}_killed", SAVE_AT)
    model, opt = runs["fsdp2"]
    loss = forward(model, "fsdp2", SAVE_AT)
    if dist.get_rank() == 1:  # SIGKILL once the next backward has begun
        loss.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
    opt.fused_backward(loss)
    raise AssertionError("rank 1 was to be killed in this backward")


def resumed(checks: dict, killed_out: Path) -> None:
    for engine in ("fsdp2", "zero3"):
        model, opt = build(engine, "adalomo_single")
        start = load(model, opt, engine, killed_out / f"{engine}_killed")
        checks[f"{engine}_start"] = start
        finish(model, opt, engine, start)
        dump(f"{engine}_after_kill_final", consolidated(model, opt))
        opt.detach()


def dies_saving() -> None:
    model, opt = build("fsdp2", "adalomo_single")
    train_step(model, opt, "fsdp2", 0)
    if dist.get_rank() == 1:
        # Dies once its shards are written, before the checkpoint is published.
        original = torch.save

        def save_then_die(obj, f, *args, **kwargs):
            if ".partial" in str(f):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(obj, f, *args, **kwargs)

        torch.save = save_then_die
    lomo_kernels.save_checkpoint(OUT / "died", model, opt, client_state={"step": 1})
    raise AssertionError("rank 1 was to be killed while saving")


def main(rank: int, checks: dict) -> None:
    warnings.simplefilter("ignore")  # DeepSpeed's and torch's notices, on every rank
    if MODE == "reference":
        reference(checks, Path(sys.argv[3]))
    elif MODE == "zero3-one-rank":
        zero3_one_rank(checks, Path(sys.argv[3]))
    elif MODE == "killed":
        killed()
    elif MODE == "resumed":
        resumed(checks, Path(sys.argv[3]))
    elif MODE == "dies-saving":
        dies_saving()
    else:
        raise SystemExit(f"unknown mode {MODE!r}")


if __name__ == "__main__":
    run_worker(lambda: deepspeed.init_distributed(dist_backend="gloo"), main, OUT)
