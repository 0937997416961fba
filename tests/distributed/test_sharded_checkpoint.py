"""Sharded checkpoints on 2 ranks (torchrun, gloo, CPU): FSDP2 through
lomo_kernels.save_checkpoint (torch.distributed.checkpoint), ZeRO-3 through DeepSpeed's own
``engine.save_checkpoint`` / ``load_checkpoint``.

A resumed run must equal the uninterrupted one bit for bit: the checkpoint holds every value
the next steps read (parameters, AdaLomo's moments, the step count, the single-backward norm
history), the batches are chosen by step, and gloo's reductions on a fixed world size are
deterministic. Moving a checkpoint between world sizes only moves values, so what is loaded
must equal what was saved bit for bit; the training after it differs from the sharded
run's only in the rounding of the gradient average, held to the sharded tests' bound.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from support.sharded_checks import (
    assert_within_update_tolerance,
    read_checks,
    run_ranks,
    run_ranks_killed,
)
from support.sharded_models import LR, SINGLE, ScaledLlama, global_batch, train_single
from support.state import assert_same_state, assert_unchanged_since, optimizer_snapshot

from lomo_kernels import AdaLomo, CheckpointError, load_checkpoint, save_checkpoint
from lomo_kernels.checkpoint import verify_checkpoint

WORKER = Path(__file__).with_name("checkpoint_worker.py")
STEPS, SAVE_AT = 4, 2  # as in the worker
ENGINES = ("fsdp2", "zero3")
SETUPS = ("lomo", "adalomo_single")


def one_process_adalomo() -> tuple[ScaledLlama, AdaLomo]:
    torch.manual_seed(0)
    model = ScaledLlama()
    return model, AdaLomo(model, lr=LR["adalomo"], **SINGLE)


def state_of(model, opt) -> dict:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


@pytest.fixture(scope="module")
def one_process_checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    """A one-process AdaLomo checkpoint after 2 steps, and the state it holds."""
    model, opt = one_process_adalomo()
    train_single(model, opt, global_batch, SAVE_AT)
    path = save_checkpoint(
        tmp_path_factory.mktemp("one") / "ckpt", model, opt, client_state=SAVE_AT
    )
    return path, state_of(model, opt)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, one_process_checkpoint) -> Path:
    out = tmp_path_factory.mktemp("reference")
    args = [str(out), "reference", str(one_process_checkpoint[0])]
    return run_ranks(WORKER, out, "checkpoint reference", args=args)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """Checkpoints of a run whose rank 1 was killed (SIGKILL) in the backward after them."""
    out = tmp_path_factory.mktemp("killed")
    run_ranks_killed(WORKER, [str(out), "killed"], "checkpoint killed")
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, killed) -> Path:
    out = tmp_path_factory.mktemp("resumed")
    return run_ranks(WORKER, out, "checkpoint resumed", args=[str(out), "resumed", str(killed)])


def saved(run: Path, name: str) -> dict:
    return torch.load(run / f"{name}.pt")


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("engine", ENGINES)
def test_resumed_from_checkpoint_equals_uninterrupted(reference, engine, setup):
    """Fresh model and optimizer objects load the step-2 checkpoint and train to step 4."""
    tag = f"{engine}_{setup}"
    assert_same_state(saved(reference, f"{tag}_resumed_final"), saved(reference, f"{tag}_final"))
    at_save = saved(reference, f"{tag}_at_save")
    assert at_save["opt"]["lomo"]["step_count"] == SAVE_AT
    assert not torch.equal(
        at_save["model"]["temperature"], saved(reference, f"{tag}_final")["model"]["temperature"]
    )


def test_fsdp2_through_torch_api_equals_uninterrupted(reference):
    """get_state_dict / dcp.save / dcp.load / set_state_dict, fresh objects, steps 3-4."""
    assert [rank["torch_api_step"] for rank in read_checks(reference)] == [SAVE_AT] * 2
    assert_same_state(
        saved(reference, "fsdp2_torch_api_final"), saved(reference, "fsdp2_adalomo_single_final")
    )


def test_zero3_two_ranks_to_one_rank(reference, tmp_path):
    """The 2-rank ZeRO-3 checkpoint through engine.load_checkpoint on one rank: the values
    saved, bit for bit."""
    args = [str(tmp_path), "zero3-one-rank", str(reference)]
    run_ranks(WORKER, tmp_path, "checkpoint ZeRO-3 on one rank", nproc=1, args=args)
    assert read_checks(tmp_path)[0]["step"] == SAVE_AT
    assert_same_state(
        saved(tmp_path, "zero3_on_one_rank"), saved(reference, "zero3_adalomo_single_at_save")
    )


def test_zero3_checkpoint_has_deepspeed_layout(reference):
    """global_step<N>/ and latest; the engine gets its own methods back at detach()."""
    assert all(rank[f"zero3_{s}_restored"] for rank in read_checks(reference) for s in SETUPS)
    for setup in SETUPS:
        directory = reference / f"zero3_{setup}"
        assert (directory / "latest").read_text() == f"global_step{SAVE_AT}"
        verify_checkpoint(directory / f"global_step{SAVE_AT}")


@pytest.mark.parametrize("engine", ENGINES)
def test_killed_run_resumes_to_the_uninterrupted_result(killed, resumed, reference, engine):
    """The processes that wrote the checkpoint were killed mid-step; new ones resume."""
    assert [rank[f"{engine}_start"] for rank in read_checks(resumed)] == [SAVE_AT, SAVE_AT]
    assert_same_state(
        saved(resumed, f"{engine}_after_kill_final"),
        saved(reference, f"{engine}_adalomo_single_final"),
    )


def test_two_ranks_to_one_process(reference):
    """The FSDP2 checkpoint in one process: the consolidated state at the save, bit for bit,
    and training on from it stays within the sharded runs' bound of the 2-rank result."""
    model, opt = one_process_adalomo()
    # Another world size: rank 0's client_state, as DeepSpeed keeps rank 0's alone.
    assert load_checkpoint(reference / "fsdp2_adalomo_single", model, opt) == {"step": SAVE_AT}
    at_save = saved(reference, "fsdp2_adalomo_single_at_save")
    assert_same_state(state_of(model, opt)["model"], at_save["model"])
    assert_same_state(opt.state_dict(), at_save["opt"])

    for step in range(SAVE_AT, STEPS):
        opt.fused_backward(model(global_batch(step)))
    final = saved(reference, "fsdp2_adalomo_single_final")["model"]
    assert_within_update_tolerance(model.state_dict(), final, at_save["model"])


def test_one_process_to_two_ranks(reference, one_process_checkpoint):
    _, state = one_process_checkpoint
    assert [rank["one_process_step"] for rank in read_checks(reference)] == [SAVE_AT] * 2
    loaded = saved(reference, "from_one_process")
    assert_same_state(loaded["model"], state["model"])
    assert_same_state(loaded["opt"], state["opt"])


def test_zero3_checkpoint_in_one_process(reference):
    """ZeRO-3 saves its flat partitions; one process loads them into flat views of its
    parameters: the consolidated state at the save, bit for bit."""
    model, opt = one_process_adalomo()
    client_state = load_checkpoint(
        reference / "zero3_adalomo_single" / f"global_step{SAVE_AT}", model, opt
    )
    assert client_state["client_state"] == {"step": SAVE_AT}  # the engine's wrapper
    at_save = saved(reference, "zero3_adalomo_single_at_save")
    assert_same_state(state_of(model, opt)["model"], at_save["model"])
    assert_same_state(opt.state_dict(), at_save["opt"])


def test_other_optimizer_class_refused_on_every_rank(reference):
    checks = read_checks(reference)
    assert checks[0]["other_class"] == checks[1]["other_class"]
    assert "holds the optimizer entry" in checks[0]["other_class"]
    assert [rank["other_class_changed"] for rank in checks] == [None, None]


def test_one_process_checkpoint_under_zero3_refused_saying_where_it_loads(reference):
    """ZeRO-3 holds its parameters flat; a checkpoint saved whole (one process, FSDP2) does
    not reshard into that: refused on every rank, nothing changed, naming where it loads."""
    checks = read_checks(reference)
    assert checks[0]["whole_into_zero3"] == checks[1]["whole_into_zero3"]
    assert "a ZeRO-3 run resumes from a ZeRO-3 checkpoint only" in checks[0]["whole_into_zero3"]
    assert [rank["whole_into_zero3_changed"] for rank in checks] == [None, None]


def assert_client_state_refused_alike(reference, name: str, says: str) -> None:
    """Both ranks refused the crafted rank-1 client_state of `name` with the same message,
    naming the file (`says` what of it), and changed nothing."""
    checks = read_checks(reference)
    refusal = checks[0][name]
    assert refusal is not None and refusal == checks[1][name], "not refused alike"
    assert f"{reference / f'crafted_{name}' / 'client_state_1.pt'} {says}" in refusal
    assert all(rank[f"{name}_unchanged"] is True for rank in checks)


def test_client_state_that_runs_code_refused_by_every_rank(reference):
    """Rank 1's client_state runs code as it is unpickled: rank 1 refuses to load it, rank 0
    (whose own file is harmless) refuses with it, and neither changes anything."""
    assert_client_state_refused_alike(reference, "runs_code", "holds a Python object")
    assert not (reference / "code-ran").exists(), "loading the checkpoint ran its code"


def test_client_state_that_is_no_torch_file_refused_by_every_rank(reference):
    """Rank 1's client_state is a truncated zip: torch.load fails on it (not for a class it
    refuses), and every rank refuses it alike instead of rank 1 raising alone and rank 0
    waiting for it in the next collective."""
    assert_client_state_refused_alike(reference, "not_torch", "is not a torch.save file")


def test_save_a_load_would_refuse_refused_by_every_rank(reference):
    """Only rank 1's client_state holds a lambda: both ranks refuse the save, naming the key,
    and neither the checkpoint nor its .partial directory is written."""
    checks = read_checks(reference)
    refusal = checks[0]["unloadable_save"]
    assert refusal is not None and refusal == checks[1]["unloadable_save"], "not refused alike"
    assert "client_state['schedule'] (a function)" in refusal
    assert not (reference / "unloadable").exists()
    assert not (reference / "unloadable.partial").exists()


def test_bad_value_in_one_ranks_slice_refused_by_every_rank(reference):
    """Checked on every rank before any rank applies: rank 0's own part passes every check,
    yet it refuses with rank 1 and changes nothing."""
    checks = read_checks(reference)
    assert checks[0]["nan_on_rank1"] == checks[1]["nan_on_rank1"]
    assert "holds inf/nan" in checks[0]["nan_on_rank1"]
    assert [rank["nan_on_rank1_changed"] for rank in checks] == [None, None]


def test_rank_killed_while_saving_leaves_a_refused_checkpoint(tmp_path):
    """Rank 1 is killed after torch.distributed.checkpoint wrote its shards and metadata,
    before the checkpoint was published: it is refused, naming what is missing."""
    run_ranks_killed(WORKER, [str(tmp_path), "dies-saving"], "checkpoint save")
    partial = tmp_path / "died.partial"
    assert (partial / ".metadata").is_file()  # torch's own loader would take it as whole
    assert not (tmp_path / "died").exists()
    model, opt = one_process_adalomo()
    before = optimizer_snapshot(model, opt)
    with pytest.raises(CheckpointError, match=r"died\.partial holds a save that did not finish"):
        load_checkpoint(tmp_path / "died", model, opt)
    with pytest.raises(CheckpointError, match=r"died\.partial/manifest\.json is missing"):
        load_checkpoint(partial, model, opt)
    assert_unchanged_since(before, model, opt)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "removed"])
def test_damaged_shard_file_refused_naming_it(reference, tmp_path, damage):
    copy = shutil.copytree(reference / "fsdp2_adalomo_single", tmp_path / "ckpt")
    shard = copy / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
        expected = "does not match its manifest's CRC-32"
    elif damage == "truncated":
        shard.write_bytes(bytes(data[:-7]))
        expected = f"holds {len(data) - 7} bytes, its manifest {len(data)}"
    else:
        shard.unlink()
        expected = "is missing: the checkpoint is incomplete"
    model, opt = one_process_adalomo()
    before = optimizer_snapshot(model, opt)
    with pytest.raises(CheckpointError, match=f"__1_0.distcp {expected}"):
        load_checkpoint(copy, model, opt)
    assert_unchanged_since(before, model, opt)
