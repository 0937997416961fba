"""DeepSpeed's engine.save_checkpoint / load_checkpoint as served for an engine trained by
Lomo/AdaLomo, in one process on a stand-in engine (the same methods on a plain model: the
2-rank ZeRO-3 runs are in tests/distributed/test_sharded_checkpoint.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
from support.crafted import Progress, RunsCode, plant_client_state
from support.models import batch, tiny_llama
from support.state import (
    assert_refused,
    assert_same_state,
    assert_unchanged_since,
    optimizer_snapshot,
)

from lomo_kernels import AdaLomo, CheckpointError, save_checkpoint
from lomo_kernels.checkpoint import restore_engine_checkpoints, serve_engine_checkpoints


def trained(steps: int, seed: int = 0):
    model = tiny_llama(seed=seed)
    opt = AdaLomo(model, lr=0.01)
    serve_engine_checkpoints(model, opt)
    for index in range(steps):
        opt.fused_backward(model(**batch(index)).loss)
    return model, opt


def test_signatures_are_deepspeeds():
    """DeepSpeed's parameters, in order; load_checkpoint adds the keyword-only
    trust_checkpoint."""
    deepspeed = pytest.importorskip("deepspeed")
    model, opt = trained(0)
    engine = deepspeed.DeepSpeedEngine
    for name, added in (("save_checkpoint", []), ("load_checkpoint", ["trust_checkpoint"])):
        ours = inspect.signature(getattr(model, name)).parameters
        theirs = list(inspect.signature(getattr(engine, name)).parameters)[1:]  # self
        assert list(ours) == theirs + added, name
        assert all(ours[p].kind is inspect.Parameter.KEYWORD_ONLY for p in added)


def test_tag_from_step_count_latest_and_client_state(tmp_path):
    model, opt = trained(2)
    assert model.save_checkpoint(tmp_path, client_state={"epoch": 1}) is True
    assert (tmp_path / "latest").read_text() == "global_step2"
    fresh, fresh_opt = trained(0, seed=1)
    path, client_state = fresh.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step2") and client_state == {"epoch": 1}
    assert_same_state(fresh.state_dict(), model.state_dict())
    assert_same_state(fresh_opt.state_dict(), opt.state_dict())


def test_module_only_and_explicit_tag(tmp_path):
    model, opt = trained(1)
    model.save_checkpoint(tmp_path, tag="mine", save_latest=False)
    assert not (tmp_path / "latest").exists()
    assert model.load_checkpoint(tmp_path) == (None, None)  # DeepSpeed's answer
    fresh, fresh_opt = trained(0, seed=1)
    moments = fresh_opt.state_dict()["state"]
    fresh.load_checkpoint(tmp_path, tag="mine", load_module_only=True)
    assert_same_state(fresh.state_dict(), model.state_dict())
    assert_same_state(fresh_opt.state_dict()["state"], moments)  # the optimizer left alone
    with pytest.raises(ValueError, match="plain directory name"):
        model.save_checkpoint(tmp_path, tag="a/b")


def test_unfinished_save_refused_naming_it(tmp_path):
    model, opt = trained(1)
    (tmp_path / "global_step1.partial").mkdir(parents=True)
    fresh, fresh_opt = trained(0, seed=1)
    before = optimizer_snapshot(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=r"global_step1\.partial holds a save that did"):
        fresh.load_checkpoint(tmp_path)
    assert_unchanged_since(before, fresh, fresh_opt)
    with pytest.raises(ValueError, match="custom_load_fn"):
        fresh.load_checkpoint(tmp_path, tag="global_step1", custom_load_fn=print)


def test_served_methods_hold_the_optimizer_weakly(tmp_path):
    model, opt = trained(1)
    del opt
    with pytest.raises(RuntimeError, match="was dropped"):
        model.save_checkpoint(tmp_path)
    model, opt = trained(1)
    restore_engine_checkpoints(model, opt)
    assert "save_checkpoint" not in model.__dict__ and "load_checkpoint" not in model.__dict__
    assert isinstance(model, torch.nn.Module)


def test_client_state_that_runs_code_refused_naming_the_file(tmp_path):
    model, _ = trained(2)
    model.save_checkpoint(tmp_path / "run", client_state={"epoch": 1})
    marker = tmp_path / "code-ran"
    record = {"client_state": {"epoch": 1}, "payload": RunsCode(marker)}
    file = plant_client_state(tmp_path / "run" / "global_step2", 0, record)
    fresh, fresh_opt = trained(1, seed=1)
    before = fresh_opt.state_dict()
    load = lambda: fresh.load_checkpoint(tmp_path / "run")
    assert_refused(fresh, fresh_opt, load, CheckpointError, rf"{file} holds a Python object")
    assert_same_state(fresh_opt.state_dict(), before)
    assert not marker.exists(), "loading the checkpoint ran the code its pickle names"


def test_trusted_checkpoint_loads_a_custom_client_state(tmp_path):
    model, opt = trained(2)
    model.save_checkpoint(tmp_path)
    record = {"client_state": {"progress": Progress(2, "x")}, "global_steps": 2}
    plant_client_state(tmp_path / "global_step2", 0, record)
    fresh, fresh_opt = trained(0, seed=1)
    with pytest.raises(CheckpointError, match=r"crafted\.Progress"):
        fresh.load_checkpoint(tmp_path)
    _, client_state = fresh.load_checkpoint(tmp_path, trust_checkpoint=True)
    assert client_state == {"progress": Progress(2, "x")}
    assert_same_state(fresh_opt.state_dict(), opt.state_dict())


def test_save_refuses_a_client_state_a_load_would_refuse(tmp_path):
    model, _ = trained(1)
    with pytest.raises(ValueError, match=r"client_state\['client_state'\]\['progress'\]"):
        model.save_checkpoint(tmp_path, client_state={"progress": Progress(1, "x")})
    assert list(tmp_path.iterdir()) == []


def with_scheduler(model, opt, kind: str):
    """The stand-in engine's lr_scheduler, as DeepSpeed's engine holds one."""
    if kind == "lambda":
        model.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
    else:
        model.lr_scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return model


ENGINE_STATES = {
    # A checkpoint of lomo_kernels.save_checkpoint (client_state a list) given as an engine's.
    "not-a-dict": ([1, 2, 3], r"client_state is a list, not the dict an engine's save writes"),
    # Saved with a StepLR, loaded into a LambdaLR (whose load would fail on 'lr_lambdas').
    "other-scheduler": ("step", r"lr_scheduler state does not load into this engine's Lambda"),
    "bad-counter": (
        {"global_steps": "two", "client_state": {}},
        r"the checkpoint's global_steps is 'two', not an int >= 0",
    ),
    # A scheduler state that loads (tried on the engine's scheduler, then undone) and a bad
    # counter after it.
    "scheduler-then-bad-counter": (
        "lambda-state",
        r"the checkpoint's skipped_steps is -1, not an int >= 0",
    ),
}


def stepped_lambda_state() -> dict:
    """A LambdaLR's state five steps on: another epoch and lr than a fresh one's."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
    for _ in range(5):
        opt.step()
        scheduler.step()
    return scheduler.state_dict()


@pytest.mark.parametrize("saved, match", ENGINE_STATES.values(), ids=ENGINE_STATES)
def test_engine_state_the_load_cannot_set_refused_before_any_change(tmp_path, saved, match):
    """What the load sets on the engine after the model and optimizer (the scheduler's state,
    the counters) is checked before either changes."""
    model, opt = trained(2)
    with_scheduler(model, opt, "step" if saved == "step" else "lambda")
    if saved == "step":
        model.save_checkpoint(tmp_path)
    else:
        if saved == "lambda-state":
            saved = {"lr_scheduler": stepped_lambda_state(), "global_steps": 2,
                     "skipped_steps": -1, "client_state": {}}  # fmt: skip
        save_checkpoint(tmp_path / "global_step2", model, opt, client_state=saved)
        (tmp_path / "latest").write_text("global_step2")
    fresh, fresh_opt = trained(1, seed=1)
    with_scheduler(fresh, fresh_opt, "lambda")
    counters = {"global_steps": 7, "global_samples": 70, "skipped_steps": 1}
    for name, value in counters.items():  # the engine's counters, as DeepSpeed's holds them
        setattr(fresh, name, value)
    schedule = fresh.lr_scheduler.state_dict()
    before = fresh_opt.state_dict()
    load = lambda: fresh.load_checkpoint(tmp_path)
    assert_refused(fresh, fresh_opt, load, CheckpointError, match)
    assert_same_state(fresh_opt.state_dict(), before)
    assert fresh.lr_scheduler.state_dict() == schedule
    assert {name: getattr(fresh, name) for name in counters} == counters


def test_a_load_sets_the_engine_counters_and_schedule(tmp_path):
    """The engine's counters and its scheduler's state come back as saved."""
    model, opt = trained(2)
    with_scheduler(model, opt, "lambda")
    for _ in range(3):
        model.lr_scheduler.step()
    counters = {"global_steps": 5, "global_samples": 40, "skipped_steps": 2}
    for name, value in counters.items():
        setattr(model, name, value)
    model.save_checkpoint(tmp_path)
    fresh, fresh_opt = trained(0, seed=1)
    with_scheduler(fresh, fresh_opt, "lambda")
    for name in counters:
        setattr(fresh, name, 0)
    fresh.load_checkpoint(tmp_path)
    assert {name: getattr(fresh, name) for name in counters} == counters
    assert fresh.lr_scheduler.state_dict() == model.lr_scheduler.state_dict()


def test_latest_is_written_without_following_a_link(tmp_path):
    """A link planted where `latest` is written (its temporary name, or `latest` itself) is
    replaced, and the file it points to left as it was."""
    model, _ = trained(1)
    save_dir, outside = tmp_path / "run", tmp_path / "outside.txt"
    save_dir.mkdir()
    outside.write_text("untouched")
    (save_dir / "latest.partial").symlink_to(outside)
    (save_dir / "latest").symlink_to(outside)
    model.save_checkpoint(save_dir)
    assert outside.read_text() == "untouched"
    for name in ("latest.partial", "latest"):
        assert not (save_dir / name).is_symlink(), name
    assert (save_dir / "latest").read_text() == "global_step1"


def test_a_scheduler_state_an_older_torch_saved_loads(tmp_path):
    """A scheduler state without a key this torch's adds (LambdaLR's `_is_initial`, saved by
    an older torch), which the scheduler's own load takes, is not refused by the check."""
    model, opt = trained(2)
    with_scheduler(model, opt, "lambda")
    model.lr_scheduler.step()
    model.save_checkpoint(tmp_path)
    file = tmp_path / "global_step2" / "client_state_0.pt"
    saved = torch.load(file, weights_only=True)
    assert saved["lr_scheduler"].pop("_is_initial", None) is not None  # this torch's key
    plant_client_state(tmp_path / "global_step2", 0, saved)
    fresh, fresh_opt = trained(0, seed=1)
    with_scheduler(fresh, fresh_opt, "lambda")
    fresh.load_checkpoint(tmp_path)
    assert fresh.lr_scheduler.last_epoch == model.lr_scheduler.last_epoch == 1
    assert_same_state(fresh_opt.state_dict()["state"], opt.state_dict()["state"])


def test_latest_is_created_with_the_mode_of_the_other_files(tmp_path):
    """Not executable: created as open() creates the manifest (0o644 under the umask)."""
    model, _ = trained(1)
    model.save_checkpoint(tmp_path)
    manifest = tmp_path / "global_step1" / "manifest.json"
    assert (tmp_path / "latest").stat().st_mode & 0o777 == manifest.stat().st_mode & 0o777
