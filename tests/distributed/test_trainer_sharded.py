"""Multi-process LomoTrainer on 2 ranks (torchrun, gloo, CPU) against LomoTrainer in one process.

The ranks run tests/distributed/trainer_sharded_worker.py once for the whole module:
LomoTrainer with TrainingArguments(deepspeed=<ZeRO-3 config>) for Lomo and AdaLomo, with exact
and single_backward clipping, and the FSDP2 plugin's set-up written by hand (accelerate turns
its FSDP plugin on for GPU ranks only) trained as LomoTrainer trains. Each is compared here
with LomoTrainer in this process on the full batch (2 ranks x 2 rows: the same 4 rows per
step), started from the same weights, with the same groups, schedule and clipping.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.dependencies import require
from support.float64 import FP32_NORM_RTOL
from support.hf_trainer import assert_skipped_steps_hold_the_warmup
from support.sharded_checks import assert_within_update_tolerance, in_order, rank_run_fixtures
from support.state import assert_same_state
from support.trainer_runs import (
    ACCUMULATE,
    EVAL,
    EVAL_ROWS,
    PER_RANK_BATCH,
    STEPS,
    WORLD,
    dataset,
    llama,
    logged,
    logged_norms,
    training_args,
)

require("deepspeed")
pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch >= 2.6")
safetensors = require("safetensors.torch")

from lomo_kernels.integrations.hf_trainer import LomoTrainer  # noqa: E402
from lomo_kernels.integrations.trainer_optimizer import (  # noqa: E402
    optimizer_class,
    optimizer_kwargs,
)

WORKER = Path(__file__).parent / "trainer_sharded_worker.py"
EXACT = ["lomo", "adalomo"]
SINGLE = ["lomo_single", "adalomo_single"]
# The norms a step logs and the evaluation losses: fp32 sums over half batches, reduced, of
# parameters within `assert_within_update_tolerance` of one process's; held to the bound of
# `support.sharded_checks.assert_single_backward_matches` (64 u; seen on AVX2: <= 1.8 u).
NORM_RTOL = FP32_NORM_RTOL


ranks_dir, checks = rank_run_fixtures(WORKER, "LomoTrainer", "ranks_dir")


class InOrderTrainer(LomoTrainer):
    """LomoTrainer whose optimizer takes each single_backward pass's gradients in `order`
    (the sharded run's), as `support.sharded_checks.in_order` explains."""

    order: list[str] = []

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            decay = self.get_decay_parameter_names(self.model)
            kwargs = optimizer_kwargs(
                self.args, self.model, decay, max_grad_norm=self.lomo_max_grad_norm
            )
            self.optimizer = in_order(optimizer_class(self.args.optim))(self.model, **kwargs)
            self.optimizer.order = self.order
        return self.optimizer


def one_process(
    name,
    initial,
    output_dir,
    trainer_class=LomoTrainer,
    resume=None,
    eval_dataset=None,
    **overrides,
):
    """LomoTrainer in this process on the full batch, from `initial` (trained, returned)."""
    model = llama()
    model.load_state_dict(initial)
    args = training_args(
        str(output_dir),
        name,
        per_device_train_batch_size=WORLD * PER_RANK_BATCH,
        per_device_eval_batch_size=WORLD * PER_RANK_BATCH,
        use_cpu=True,
        **overrides,
    )
    trainer = trainer_class(
        model=model, args=args, train_dataset=dataset(), eval_dataset=eval_dataset
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture(scope="module")
def reference(ranks_dir, tmp_path_factory):
    """The one-process Trainer run of each exact-clipping run, computed once."""
    runs = {}

    def get(name):
        if name not in runs:
            saved = torch.load(ranks_dir / f"{name}.pt")
            output_dir = tmp_path_factory.mktemp(f"one_process_{name}")
            runs[name] = one_process(
                name,
                saved["initial"],
                output_dir,
                eval_dataset=dataset(EVAL_ROWS),
                save_strategy="steps",
                save_steps=STEPS,
                **EVAL,
            )
        return runs[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT)
def test_trainer_zero3_equals_one_process(ranks_dir, checks, reference, name):
    """Exact clipping (a norm pass with its own forward, then the update), weight decay on
    transformers' decay group, the linear schedule, evaluations after steps 2 and 3:
    parameters, logged norms and evaluation losses."""
    saved = torch.load(ranks_dir / f"{name}.pt")
    trainer = reference(name)
    assert_within_update_tolerance(saved["final"], trainer.model.state_dict(), saved["initial"])
    norms = logged_norms(trainer)
    assert len(norms) == STEPS and min(norms) > trainer._lomo().clip_grad_norm  # all clipped
    for rank in checks:
        assert rank[name]["phases"] == ["norm", "update"] * STEPS
        assert rank[name]["norms"] == pytest.approx(norms, rel=NORM_RTOL)
        eval_losses = logged(trainer, "eval_loss")
        assert len(eval_losses) == 2  # after step 2 and after the last step
        assert rank[name]["eval_losses"] == pytest.approx(eval_losses, rel=NORM_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", SINGLE)
def test_trainer_zero3_single_backward_equals_one_process(ranks_dir, checks, tmp_path, name):
    """optim_args="single_backward=True": one forward and one backward per step; against one
    process taking the gradients in the order the ZeRO-3 buckets delivered them."""
    saved = torch.load(ranks_dir / f"{name}.pt")
    InOrderTrainer.order = saved["order"]
    trainer = one_process(name, saved["initial"], tmp_path, trainer_class=InOrderTrainer)
    assert trainer._lomo().single_backward
    assert_within_update_tolerance(saved["final"], trainer.model.state_dict(), saved["initial"])
    norms = logged_norms(trainer)
    for rank in checks:
        assert rank[name]["phases"] == ["update"] * STEPS
        assert rank[name]["norms"] == pytest.approx(norms, rel=NORM_RTOL)


@pytest.mark.slow
def test_trainer_zero3_accumulation_equals_one_process(ranks_dir, checks, tmp_path):
    """gradient_accumulation_steps=2 with the Trainer's clipping under ZeRO-3: one backward per
    micro-batch (the step's norm is the accumulated gradients', measured as they are added,
    with no norm pass and no forward of its own), against one process accumulating the same
    micro-batches of 4 rows."""
    name = "lomo_accumulate"
    saved = torch.load(ranks_dir / f"{name}.pt")
    trainer = one_process(name, saved["initial"], tmp_path, **ACCUMULATE)
    assert trainer._lomo().accumulation_steps == 2 and trainer._lomo().step_count == 2
    assert_within_update_tolerance(saved["final"], trainer.model.state_dict(), saved["initial"])
    norms = logged_norms(trainer)
    assert len(norms) == 2 and min(norms) > trainer._lomo().clip_grad_norm  # all clipped
    for rank in checks:
        assert rank[name]["phases"] == ["accumulate"] * 4 and rank[name]["steps"] == 2
        assert rank[name]["norms"] == pytest.approx(norms, rel=NORM_RTOL)


@pytest.mark.slow
def test_trainer_ranks_split_each_step_of_one_process(ranks_dir):
    """Step k of the 2-rank run takes the one process's rows 4k..4k+3, 2 on each rank."""
    rows = torch.stack([row["input_ids"] for row in dataset()])
    for name in EXACT + SINGLE:
        per_rank = torch.load(ranks_dir / f"{name}.pt")["batches"]
        assert len(per_rank) == WORLD and all(len(steps) == STEPS for steps in per_rank)
        for step in range(STEPS):
            got = torch.cat([steps[step] for steps in per_rank])
            span = WORLD * PER_RANK_BATCH
            assert torch.equal(got, rows[step * span : (step + 1) * span])


@pytest.mark.slow
def test_trainer_zero3_partitions_the_model(checks):
    """The runs are sharded for real: ZeRO-3 partitions (the large tensors) and persistent
    parameters kept whole (the small ones, refreshed after each update) both occur."""
    for rank in checks:
        for name in EXACT + SINGLE:
            assert rank[name]["sharded"] == "Zero3Sharding"
            assert rank[name]["partitioned"] > 0 and rank[name]["persistent"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT)
def test_trainer_zero3_checkpoint_resumes_in_one_process(ranks_dir, reference, tmp_path, name):
    """The checkpoint of step 3 holds the consolidated weights; resumed in one process for a
    4th step it continues as the one-process run's own checkpoint does (optimizer state,
    schedule and data position included)."""
    saved = torch.load(ranks_dir / f"{name}.pt")
    checkpoint = ranks_dir / name / f"checkpoint-{STEPS}"
    weights = safetensors.load_file(checkpoint / "model.safetensors")
    assert weights.keys() == saved["final"].keys()
    assert all(torch.equal(weights[k], v) for k, v in saved["final"].items())
    own = Path(reference(name).args.output_dir) / f"checkpoint-{STEPS}"
    steps = STEPS + 1
    resumed, expected = (
        one_process(name, saved["initial"], tmp_path / label, resume=str(path), max_steps=steps)
        for label, path in (("sharded", checkpoint), ("own", own))
    )
    # The optimizer state came back with the step count: the 4th step is its 4th.
    assert resumed._lomo().step_count == expected._lomo().step_count == steps
    assert_within_update_tolerance(
        resumed.model.state_dict(), expected.model.state_dict(), saved["initial"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT)
def test_fsdp2_plugin_setup_by_hand_equals_one_process_trainer(ranks_dir, checks, reference, name):
    """What accelerate's FSDP2 plugin sets up (fully_shard per decoder layer and the root),
    trained with LomoTrainer's groups, linear schedule and exact clipping on the batches the
    Trainer gave each rank, equals LomoTrainer in one process."""
    saved = torch.load(ranks_dir / f"fsdp2_{name}.pt")
    trainer = reference(name)
    assert_within_update_tolerance(saved["final"], trainer.model.state_dict(), saved["initial"])
    for rank in checks:
        run = rank[f"fsdp2_{name}"]
        assert run["steps"] == STEPS and run["phases"] == ["norm", "update"] * STEPS
        assert run["norms"] == pytest.approx(logged_norms(trainer), rel=NORM_RTOL)


@pytest.mark.slow
def test_trainer_zero3_resumes_sharded(ranks_dir, checks):
    """train(resume_from_checkpoint=...) under ZeRO-3: a new trainer in the same 2 ranks
    loads the sharded step-2 checkpoint and ends with the uninterrupted run's parameters and
    AdaLomo state bit for bit, having applied the same learning rates to the same batches."""
    saved = torch.load(ranks_dir / "resume.pt")
    assert_same_state(saved["resumed"]["final"], saved["uninterrupted"]["final"])
    assert_same_state(saved["resumed"]["opt"], saved["uninterrupted"]["opt"])
    checkpoint = ranks_dir / "resume" / "checkpoint-2"
    assert (checkpoint / "latest").read_text() == "global_step2"
    assert (checkpoint / "global_step2" / "manifest.json").is_file()
    for rank in checks:
        run, resumed = rank["resume"]["uninterrupted"], rank["resume"]["resumed"]
        assert run["step_count"] == resumed["step_count"] == 4
        assert len(run["batches"]) == 4 and resumed["batches"] == run["batches"][2:]
        assert resumed["lrs"] == run["lrs"][2:] and len(set(run["lrs"])) == 4  # a schedule
        # The log history comes back with the trainer state and goes on as it was.
        assert resumed["logged_lrs"] == run["logged_lrs"]
    assert checks[0]["resume"]["resumed"]["batches"] != checks[1]["resume"]["resumed"]["batches"]


REFUSALS = {
    "stage2": "zero_optimization.stage=2: LomoTrainer needs stage 3",
    "optimizer_block": "sets 'optimizer'",
    "scheduler_block": "sets 'scheduler'",
    "offload_param": "zero_optimization.offload_param",
    "given_optimizer": "optimizers=(...) under DeepSpeed",
    "process_count": "accelerate counts 1 process(es) but torch.distributed runs 2 ranks",
    "ddp": "2 processes without DeepSpeed ZeRO-3",
    "fsdp2_plugin": "accelerate did not enable FSDP",
}


@pytest.mark.slow
def test_trainer_unsupported_multi_process_setups_refused(checks):
    """On 2 ranks: each refused with its reason, before the model changed."""
    for rank in checks:
        assert rank["refusals"].keys() == REFUSALS.keys()
        for key, expected in REFUSALS.items():
            assert expected in (rank["refusals"][key] or ""), (key, rank["refusals"][key])
        assert rank["refusals_unchanged"]


@pytest.mark.slow
def test_trainer_resume_running_code_refused_by_every_rank(ranks_dir, checks):
    """train(resume_from_checkpoint=...) under ZeRO-3 from a checkpoint whose rank-1
    client_state runs code as it is unpickled: both ranks refuse it, naming the file, before
    the parameters or the optimizer state change, and the code never runs."""
    crafted = ranks_dir / "crafted" / "checkpoint-2" / "global_step2" / "client_state_1.pt"
    refusal = checks[0]["resume_runs_code"]
    assert refusal is not None and refusal == checks[1]["resume_runs_code"], "not refused alike"
    assert f"{crafted} holds a Python object" in refusal
    assert all(rank["resume_runs_code_unchanged"] is True for rank in checks)
    assert not (ranks_dir / "code-ran").exists(), "resuming ran the checkpoint's code"


def test_fp16_steps_skipped_under_zero3_hold_the_lr_schedule(checks):
    """As in one process (test_hf_trainer.py): each step runs at transformers' warm-up
    schedule for the steps applied before it, on every rank."""
    steps = checks[0]["fp16_schedule"]
    assert steps == checks[1]["fp16_schedule"] and len(steps) == 8
    # The worker's lr 0.01, warm-up 4 of 8 steps.
    assert_skipped_steps_hold_the_warmup(steps, 0.01, 4)
