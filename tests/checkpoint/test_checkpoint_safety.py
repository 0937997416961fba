"""A checkpoint is read without running code it holds (lomo_kernels.load_checkpoint in one
process; the served engine methods are in test_engine_checkpoint_methods.py, 2 ranks in
tests/distributed/test_sharded_checkpoint.py).

A crafted file (its pickle creates a marker file as it is loaded) must be refused, naming the
file, with the marker never written and the model and optimizer unchanged bit for bit; a
value a safe load would refuse must be refused at save, before anything is written; a
checkpoint the caller trusts loads its custom objects.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.checkpointed import trained_with_moments as trained
from support.crafted import (
    Progress,
    RunsCode,
    plant_client_state,
    plant_metadata,
    rerecord_manifest,
)
from support.models import tiny_llama
from support.state import assert_refused, assert_same_state

from lomo_kernels import CheckpointError, Lomo, load_checkpoint, save_checkpoint
from lomo_kernels.checkpoint import safe_loading
from lomo_kernels.checkpoint.state import model_state, optimizer_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "code-ran"


def assert_refused_running_nothing(model, opt, load, match: str, marker) -> None:
    """`load()` is refused (CheckpointError matching `match`), the parameters, the optimizer's
    tensors and its whole state_dict unchanged bit for bit, and no code of the file ran."""
    before = opt.state_dict()
    assert_refused(model, opt, load, CheckpointError, match)
    assert_same_state(opt.state_dict(), before)
    assert not marker.exists(), "loading the checkpoint ran the code its pickle names"


def test_client_state_that_runs_code_refused_naming_the_file(checkpoint, marker):
    file = plant_client_state(checkpoint, 0, {"step": 1, "payload": RunsCode(marker)})
    model, opt = trained(seed=1, steps=2)
    load = lambda: load_checkpoint(checkpoint, model, opt)
    match = rf"{file} holds a Python object .*io\.open.*trust_checkpoint=True"
    assert_refused_running_nothing(model, opt, load, match, marker)


def test_metadata_that_runs_code_refused_naming_the_file(checkpoint, marker):
    file = plant_metadata(checkpoint, RunsCode(marker))
    model, opt = trained(seed=1, steps=2)
    load = lambda: load_checkpoint(checkpoint, model, opt)
    match = rf"{file} is not torch.distributed.checkpoint metadata \(it names io\.open\)"
    assert_refused_running_nothing(model, opt, load, match, marker)


def test_optimizer_entry_that_runs_code_refused_naming_it(checkpoint, marker):
    """A non-tensor entry torch.distributed.checkpoint pickles (here a learning rate),
    written by a tool that does not check what it saves."""
    model, opt = trained()
    state = {"model": model_state(model), "optimizer": optimizer_state(model, opt)}
    state["optimizer"]["param_groups"][0]["lr"] = RunsCode(marker)
    (checkpoint / ".metadata").unlink()  # written anew (torch warns over an existing one)
    dcp.save(state, checkpoint_id=checkpoint, no_dist=True)
    rerecord_manifest(checkpoint)
    model, opt = trained(seed=1, steps=2)
    load = lambda: load_checkpoint(checkpoint, model, opt)
    match = r"the checkpoint's 'optimizer.param_groups.0.lr' holds a Python object"
    assert_refused_running_nothing(model, opt, load, match, marker)


def test_torch_that_unpickles_tensors_refused_unless_trusted(checkpoint, monkeypatch):
    monkeypatch.setattr(safe_loading, "TORCH_READS_TENSORS_SAFELY", False)
    model, opt = trained(seed=1, steps=2)
    load = lambda: load_checkpoint(checkpoint, model, opt)
    assert_refused(model, opt, load, CheckpointError, "upgrade torch to 2.6 or newer")
    assert load_checkpoint(checkpoint, model, opt, trust_checkpoint=True) == {"step": 1}


def test_trusted_checkpoint_loads_a_custom_object(tmp_path):
    """A checkpoint whose client_state holds a class of the caller's own (as an older version
    wrote, or a DeepSpeed run): refused by default, loaded when trusted."""
    model, opt = trained()
    path = save_checkpoint(tmp_path / "ckpt", model, opt, client_state=None)
    file = plant_client_state(path, 0, {"progress": Progress(3, "warm-up done")})
    fresh, fresh_opt = trained(seed=1, steps=2)
    load = lambda: load_checkpoint(path, fresh, fresh_opt)
    assert_refused(fresh, fresh_opt, load, CheckpointError, rf"{file} .*crafted\.Progress")
    client_state = load_checkpoint(path, fresh, fresh_opt, trust_checkpoint=True)
    assert client_state == {"progress": Progress(3, "warm-up done")}
    assert_same_state(fresh.state_dict(), model.state_dict())
    assert_same_state(fresh_opt.state_dict(), opt.state_dict())


UNSAFE = {
    "lambda": (
        {"step": 1, "schedule": lambda step: 0.9**step},
        r"client_state\['schedule'\] \(a function\): it cannot be pickled",
    ),
    "nested-custom-class": (
        {"run": [0, Progress(1, "x")]},
        r"client_state\['run'\]\[1\] \(a Progress\): .*crafted\.Progress",
    ),
    "custom-class": (Progress(1, "x"), r"client_state \(a Progress\)"),
}


@pytest.mark.parametrize("client_state, named", UNSAFE.values(), ids=UNSAFE)
def test_save_refuses_what_a_load_would_refuse_writing_nothing(tmp_path, client_state, named):
    model, opt = trained()
    path = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=rf"save_checkpoint: {named}.*Nothing was written"):
        save_checkpoint(path, model, opt, client_state=client_state)
    assert not path.exists() and not path.with_name("ckpt.partial").exists()


def test_save_refuses_an_optimizer_entry_a_load_would_refuse(tmp_path):
    model = tiny_llama()
    opt = Lomo(model, lr=0.05)
    opt.param_groups[0]["on_step"] = lambda: None  # torch keeps extra param-group keys
    path = tmp_path / "ckpt"
    match = r"the optimizer's state\['optimizer.param_groups.0.on_step'\] \(a function\)"
    with pytest.raises(ValueError, match=match):
        save_checkpoint(path, model, opt)
    assert not path.exists() and not path.with_name("ckpt.partial").exists()


def test_what_a_safe_load_accepts_round_trips(tmp_path):
    """Tensors, containers, numbers, strings, RNG states: saved and loaded as they were."""
    model, opt = trained()
    client_state = {
        "step": 7,
        "loss": 2.5,
        "name": "run-a",
        "done": False,
        "nothing": None,
        "rng": torch.get_rng_state(),
        "history": [1.0, (2, 3)],
        "dtype": torch.bfloat16,
    }
    path = save_checkpoint(tmp_path / "ckpt", model, opt, client_state=client_state)
    assert_same_state(load_checkpoint(path, *trained(seed=1)), client_state)
