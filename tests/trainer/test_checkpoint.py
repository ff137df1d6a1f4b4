"""Checkpoints: async and sync saves round-trip the whole training state, commits are atomic,
only complete checkpoints are resumed from, and only the newest `keep` are kept."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from trainer.checkpoint import COMPLETE, CheckpointMismatch, Checkpointer, complete_checkpoints, train_state


class Position:
    """Stands in for the data loader: anything with state_dict / load_state_dict."""

    def __init__(self, epoch: int = 0, position: int = 0):
        self.sd = {"epoch": epoch, "position": position}

    def state_dict(self) -> dict:
        return dict(self.sd)

    def load_state_dict(self, sd: dict) -> None:
        self.sd = dict(sd)


def make(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def checkpointer(root, model, opt, sched, data=None, **kwargs) -> Checkpointer:
    """A Checkpointer with the training state registered once, as the trainer makes it."""
    return Checkpointer(root, state=train_state(model, opt, sched, data or Position()), **kwargs)


def train_steps(model, opt, sched, n: int) -> None:
    for _ in range(n):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.parametrize("async_save", [True, False])
def test_round_trip_of_the_whole_state(group, tmp_path, async_save):
    model, opt, sched = make(0)
    train_steps(model, opt, sched, 3)
    ck = checkpointer(tmp_path / "ck", model, opt, sched, Position(1, 40), keep=2, async_save=async_save)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    ck.save(3)
    expected_rng = (random.random(), np.random.rand(), torch.rand(1))
    ck.wait()
    assert [s for s, _ in complete_checkpoints(tmp_path / "ck")] == [3]

    model2, opt2, sched2 = make(1)  # different weights, fresh optimizer
    data = Position()
    assert checkpointer(tmp_path / "ck", model2, opt2, sched2, data, keep=2).restore() == 3
    assert data.sd == {"epoch": 1, "position": 40}
    assert sched2.last_epoch == sched.last_epoch == 3
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected_rng  # RNG resumes where it was
    # Training on from the restored state is identical to training on from the original.
    torch.manual_seed(9)
    train_steps(model, opt, sched, 2)
    torch.manual_seed(9)
    train_steps(model2, opt2, sched2, 2)
    assert torch.equal(model[0].weight, model2[0].weight)


def test_async_save_does_not_see_later_updates(group, tmp_path):
    model, opt, sched = make(0)
    ck = checkpointer(tmp_path, model, opt, sched, keep=3)
    ck.save(1)
    saved = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # training goes on while the write is in flight
    ck.wait()
    model2, opt2, sched2 = make(1)
    checkpointer(tmp_path, model2, opt2, sched2, keep=3).restore()
    assert torch.equal(model2[0].weight, saved)


def test_interrupted_saves_are_ignored_on_resume(group, tmp_path):
    model, opt, sched = make(0)
    position = Position(0, 4)
    ck = checkpointer(tmp_path, model, opt, sched, position, keep=3, async_save=False)
    ck.save(4)
    good = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    # A crash mid-write leaves a temporary directory: here a real, fully written save of step 8
    # whose commit never happened, and a step-12 one cut short (only part of its files).
    ck.async_save = True
    position.sd["position"] = 8
    ck.save(8)
    ck._pending[1].result()
    ck._pending = None  # the process "dies" before committing
    shutil.copytree(tmp_path / ".tmp-step_00000008", tmp_path / ".tmp-step_00000012")
    (tmp_path / ".tmp-step_00000012" / ".metadata").unlink()
    # ... or dies between the rename and the marker.
    shutil.copytree(tmp_path / ".tmp-step_00000008", tmp_path / "step_00000016")

    model2, opt2, sched2 = make(1)
    data = Position()
    resumed = checkpointer(tmp_path, model2, opt2, sched2, data, keep=3)  # the restarted job
    assert resumed.latest()[0] == 4
    assert not list(tmp_path.glob(".tmp-*"))  # stale partial writes cleared at start
    assert resumed.restore() == 4
    assert torch.equal(model2[0].weight, good) and data.sd == {"epoch": 0, "position": 4}
    # The next commit replaces the uncommitted leftover of a later step too.
    resumed.async_save = False
    resumed.save(16)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 16]
    assert (tmp_path / "step_00000016" / COMPLETE).is_file()


def test_keeps_the_newest_checkpoints(group, tmp_path):
    model, opt, sched = make(0)
    root = tmp_path / "ck"
    position = Position()
    ck = checkpointer(root, model, opt, sched, position, keep=2)
    for step in (10, 20, 30, 40):
        position.sd["position"] = step
        ck.save(step)
        ck.poll()
    ck.wait()
    assert [s for s, _ in complete_checkpoints(root)] == [30, 40]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000030", "step_00000040"]


def test_no_checkpoint_means_step_zero(group, tmp_path):
    model, opt, sched = make(0)
    before = model[0].weight.detach().clone()
    assert checkpointer(tmp_path / "empty", model, opt, sched, keep=1).restore() == 0
    assert torch.equal(model[0].weight, before)


def test_a_checkpoint_of_another_model_is_a_clear_error(group, tmp_path):
    model, opt, sched = make(0)
    checkpointer(tmp_path / "ck", model, opt, sched, keep=1, async_save=False).save(1)
    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    other_opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(CheckpointMismatch, match=r"step_00000001 does not fit this model and optimizer .*Size mismatch"):
        checkpointer(tmp_path / "ck", other, other_opt, torch.optim.lr_scheduler.LambdaLR(other_opt, lambda s: 1.0),
                     keep=1).restore()
