"""`LomoTrainer.train(resume_from_checkpoint=True)` resumes from the newest whole checkpoint:
a folder whose save did not finish (a rank died while writing it) is passed over, named."""

from __future__ import annotations

import re
import shutil
import warnings

import pytest
from support.hf_trainer import args, dataset
from support.models import tiny_llama
from support.state import assert_same_state

from lomo_kernels.integrations.hf_trainer import LomoTrainer
from lomo_kernels.integrations.trainer_checkpoints import last_whole_checkpoint, missing_part


class CountingTrainer(LomoTrainer):
    """Counts the training steps this run takes itself (not those a resume skips)."""

    steps_taken = 0

    def training_step(self, *args, **kwargs):
        self.steps_taken += 1
        return super().training_step(*args, **kwargs)


def run(tmp_path, max_steps: int, resume=None) -> CountingTrainer:
    trainer = CountingTrainer(
        model=tiny_llama(),
        args=args(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2),
        train_dataset=dataset(16),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("lost", ["trainer_state.json", "optimizer.pt", "scheduler.pt"])
def test_resume_true_passes_over_an_unfinished_checkpoint(tmp_path, lost):
    uninterrupted = run(tmp_path / "whole", 6)
    interrupted = tmp_path / "interrupted"
    run(interrupted, 6)
    shutil.rmtree(interrupted / "checkpoint-6")  # only the last two survive a death at 6:
    (interrupted / "checkpoint-4" / lost).unlink()  # step 4's save did not finish
    with pytest.warns(UserWarning, match=f"passes over .*checkpoint-4: .*{lost} is missing"):
        resumed = run(interrupted, 6, resume=True)
    assert resumed.state.global_step == 6
    # Resumed from step 2 (steps 3 to 6 taken; a run from the start, which the same data
    # would lead to the same weights, takes 6): the same parameters as the uninterrupted run.
    assert (resumed.steps_taken, uninterrupted.steps_taken) == (4, 6)
    assert_same_state(resumed.model.state_dict(), uninterrupted.model.state_dict())


def test_no_whole_checkpoint_refused(tmp_path):
    run(tmp_path, 2)
    (tmp_path / "checkpoint-2" / "trainer_state.json").unlink()
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no whole checkpoint"):
        run(tmp_path, 4, resume=True)


def test_sharded_checkpoint_needs_latest_and_its_manifest(tmp_path):
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    for name in ("trainer_state.json", "scheduler.pt"):
        (folder / name).write_text("{}")
    assert missing_part(folder, sharded=True) == f"{folder / 'latest'} is missing"
    (folder / "latest").write_text("global_step3")
    manifest = folder / "global_step3" / "manifest.json"
    assert missing_part(folder, sharded=True) == f"{manifest} is missing"
    (folder / "global_step3").mkdir()
    manifest.write_text("{}")
    assert missing_part(folder, sharded=True) is None
    assert last_whole_checkpoint(str(tmp_path), sharded=True) == str(folder)
    assert missing_part(folder, sharded=False) == f"{folder / 'optimizer.pt'} is missing"


@pytest.mark.parametrize("tag", ["../elsewhere/global_step1", "/abs/global_step1", ".."])
def test_latest_naming_a_folder_elsewhere_is_not_whole(tmp_path, tag):
    """``latest`` is a plain name of a folder beside it: one that leads elsewhere (even to a
    whole checkpoint there) makes the folder not whole, and the older whole one is taken."""
    older, newer = tmp_path / "checkpoint-5", tmp_path / "checkpoint-10"
    elsewhere = tmp_path / "elsewhere" / "global_step1"
    for folder, latest in ((older, "global_step5"), (newer, tag)):
        folder.mkdir()
        for name in ("trainer_state.json", "scheduler.pt"):
            (folder / name).write_text("{}")
        (folder / "latest").write_text(latest)
    (older / "global_step5").mkdir()
    (older / "global_step5" / "manifest.json").write_text("{}")
    elsewhere.mkdir(parents=True)
    (elsewhere / "manifest.json").write_text("{}")
    expected = rf"passes over .*checkpoint-10: .*latest names '{re.escape(tag)}', not a"
    with pytest.warns(UserWarning, match=expected):
        assert last_whole_checkpoint(str(tmp_path), sharded=True) == str(older)


def test_only_what_transformers_names_a_checkpoint_is_one(tmp_path):
    """A copy beside the checkpoints ("checkpoint-12-backup") and a file named like one are
    no checkpoints, as for transformers' own `get_last_checkpoint`: the whole checkpoint-5
    is taken, with no folder passed over."""
    from transformers.trainer_utils import get_last_checkpoint

    for name in ("checkpoint-5", "checkpoint-12-backup"):
        (tmp_path / name).mkdir()
        for part in ("trainer_state.json", "scheduler.pt", "optimizer.pt"):
            (tmp_path / name / part).write_text("{}")
    (tmp_path / "checkpoint-20").write_text("")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "passes over" warning
        found = last_whole_checkpoint(str(tmp_path), sharded=False)
    assert found == get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-5")
