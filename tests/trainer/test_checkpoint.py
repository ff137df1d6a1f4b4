"""Checkpoints: async and sync saves round-trip the whole training state, commits are atomic,
only complete checkpoints are resumed from, and only the newest `keep` are kept. Each rank hashes
the files it wrote; a restore verifies each file once, split across the ranks at any world size."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ranks import logged, spawn

import supernode.core.checkpoints
from supernode.core.checkpoints import (
    COMPLETE,
    TRUST_UNCHECKED_ENV,
    checkpoint_problem,
    complete_checkpoints,
    read_marker,
)
from supernode.core.files import sha256_file
from supernode.trainer.checkpoint import (
    CheckpointCorrupt,
    Checkpointer,
    CheckpointMismatch,
    MissingDigest,
    NoSpace,
    train_state,
)


class Position:
    """Stands in for the data loader: anything with state_dict / load_state_dict."""

    def __init__(self, epoch: int = 0, position: int = 0):
        self.sd = {"epoch": epoch, "position": position}

    def state_dict(self) -> dict:
        return dict(self.sd)

    def load_state_dict(self, sd: dict) -> None:
        self.sd = dict(sd)


def make(seed: int, world: int = 1):
    """A small model, optimizer and schedule; with `world` > 1 its parameters are sharded over the
    ranks (FSDP2, uneven shards), as the trainer shards them."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
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


def full_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


@contextlib.contextmanager
def counting_hashes():
    """The names of the files the checkpointer hashes in this process, in order."""
    hashed: list[str] = []

    def counted(path):
        hashed.append(Path(path).name)
        return sha256_file(path)

    supernode.core.checkpoints.sha256_file = counted  # the check every reader shares
    try:
        yield hashed
    finally:
        supernode.core.checkpoints.sha256_file = sha256_file


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
    with pytest.raises(
        CheckpointMismatch, match=r"step_00000001 does not fit this model and optimizer .*Size mismatch"
    ):
        checkpointer(
            tmp_path / "ck", other, other_opt, torch.optim.lr_scheduler.LambdaLR(other_opt, lambda s: 1.0), keep=1
        ).restore()


@pytest.mark.parametrize("marker", ["no-files", "files-not-a-dict", "not-json"])
def test_a_marker_without_checksums_is_never_trusted_silently(group, tmp_path, monkeypatch, marker):
    """Issue 30 #3: a COMPLETE marker lacking its sha256 (or unreadable) used to be trusted, so flipped
    weights resumed silently and were re-checkpointed under fresh checksums."""
    model, opt, sched = make(0)
    checkpointer(tmp_path, model, opt, sched, keep=2, async_save=False).save(1)
    trained = model[0].weight.detach().clone()
    path = tmp_path / "step_00000001"
    m = json.loads((path / COMPLETE).read_text())
    body = {"no-files": {k: v for k, v in m.items() if k != "files"}, "files-not-a-dict": {**m, "files": []}}
    (path / COMPLETE).write_text("{not json" if marker == "not-json" else json.dumps(body[marker]))
    problem = checkpoint_problem(path)  # what the restore drill and the export check
    assert problem and str(path / COMPLETE) in problem
    model2, opt2, sched2 = make(1)
    with pytest.raises(CheckpointCorrupt, match="no usable checkpoint"):
        checkpointer(tmp_path, model2, opt2, sched2, keep=2).restore()
    if marker == "not-json":
        return
    # The explicit opt-in for checkpoints from before checksums: used, and the restore says so.
    monkeypatch.setenv(TRUST_UNCHECKED_ENV, "1")
    assert checkpoint_problem(path) is None
    with logged() as said:
        assert checkpointer(tmp_path, model2, opt2, sched2, keep=2).restore() == 1
    assert torch.equal(model2[0].weight, trained)
    assert any("used unverified" in line for line in said)


def test_a_step_directory_without_its_marker_is_named_and_kept(group, tmp_path):
    """Issue 30, also seen: it was skipped, then deleted by the next commit without a word."""
    model, opt, sched = make(0)
    checkpointer(tmp_path, model, opt, sched, keep=3, async_save=False).save(2)
    (tmp_path / "step_00000002" / COMPLETE).unlink()
    with logged() as said:
        ck = checkpointer(tmp_path, model, opt, sched, keep=3, async_save=False)
    assert [line for line in said if "step_00000002 has no COMPLETE marker" in line and "kept" in line]
    assert ck.restore() == 0
    ck.save(4)
    assert (tmp_path / "step_00000002").is_dir() and [s for s, _ in complete_checkpoints(tmp_path)] == [4]


# -- checksums at scale: each rank hashes its own files, a restore splits the check --------------


def save_three_steps(rank: int, world: int, root: Path):
    """Rank `rank` of `world`: saves steps 2, 4, 6 (async), each stopped between the write and the
    commit so that rank 0 can read the ranks' digest files; the digest of rank 1 is removed before
    step 6 commits. Returns (rank 0) {step: (digest files, data files)} and the weights of step 4."""
    model, opt, sched = make(0, world)
    ck = checkpointer(root, model, opt, sched, keep=3)
    seen, saved = {}, {}
    for step in (2, 4, 6):
        train_steps(model, opt, sched, 1)
        ck.save(step)
        if step == 4:
            saved = full_weights(model)
        ck.wait_for_staging()
        ck._pending[1].result()  # written by every rank, not committed yet
        dist.barrier()
        tmp = root / f".tmp-step_{step:08d}"
        if rank == 0:
            seen[step] = (
                {p.name: json.loads(p.read_text()) for p in tmp.glob(".sha256.*")},
                sorted(p.name for p in tmp.iterdir() if not p.name.startswith(".sha256.")),
            )
        if step == 6 and rank == 0:
            (tmp / ".sha256.1").unlink()
            with pytest.raises(
                MissingDigest,
                match=rf"checkpoint {tmp} not committed: no rank recorded a sha256 "
                r"for __1_0\.distcp \(its \.sha256\.<rank> file is missing\)",
            ):
                ck.wait()
        else:
            ck.wait()
        dist.barrier()
    ck.close()
    return seen, saved


def restore_counting_hashes(rank: int, world: int, root: Path):
    model, opt, sched = make(1, world)
    with counting_hashes() as hashed:
        step = checkpointer(root, model, opt, sched, keep=3).restore()
    return step, hashed, full_weights(model)


@pytest.mark.slow
def test_each_rank_hashes_its_files_and_a_restore_at_another_world_size_checks_each_once(tmp_path):

    root = tmp_path / "ck"
    seen, saved = spawn(save_three_steps, 3, tmp_path / "save", root)[0]
    for digests, files in seen.values():
        assert sorted(digests) == [".sha256.0", ".sha256.1", ".sha256.2", ".sha256.metadata"]
        for rank in range(3):  # exactly the files rank r wrote, with the digests of their bytes
            assert sorted(digests[f".sha256.{rank}"]) == [f for f in files if f.startswith(f"__{rank}_")] != []
        assert list(digests[".sha256.metadata"]) == [".metadata"]
        assert len(files) == 4
    # Step 6 lacked rank 1's digests: not committed, its partial directory gone.
    assert [s for s, _ in complete_checkpoints(root)] == [2, 4]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
    for step, path in complete_checkpoints(root):  # the merged marker is the serial hash of every file
        on_disk = {p.name: sha256_file(p) for p in path.iterdir() if p.name != COMPLETE}
        assert read_marker(path)["files"] == on_disk
        assert sorted(on_disk) == seen[step][1]  # the digest files were merged, not kept
        assert checkpoint_problem(path) is None  # one process checks every file (drill, export)

    ranks = spawn(restore_counting_hashes, 2, tmp_path / "restore", root)  # written by 3 ranks, read by 2
    assert [step for step, _, _ in ranks] == [4, 4]
    hashed = [names for _, names, _ in ranks]
    assert all(hashed) and sorted(hashed[0] + hashed[1]) == sorted(seen[4][1])  # every file once, none twice
    for _, _, weights in ranks:
        assert weights.keys() == saved.keys() and all(torch.equal(weights[k], saved[k]) for k in saved)


def test_a_save_with_a_missing_digest_file_is_not_committed(group, tmp_path):
    model, opt, sched = make(0)
    ck = checkpointer(tmp_path, model, opt, sched, keep=2)
    ck.save(1)
    ck.wait()
    ck.save(2)
    ck.wait_for_staging()
    ck._pending[1].result()
    (tmp_path / ".tmp-step_00000002" / ".sha256.metadata").unlink()
    with pytest.raises(MissingDigest, match=r"no rank recorded a sha256 for \.metadata"):
        ck.wait()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1] and not list(tmp_path.glob(".tmp-*"))
    ck.save(3)  # the next save is unaffected
    ck.close()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 3]


# -- a real full disk (issue 30 #5) ---------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_a_real_full_disk_is_no_space_and_leaves_no_partial_save(group, small_disk, async_save):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8192), torch.nn.Linear(8192, 4))  # ~1.2 MB with AdamW state
    opt = torch.optim.AdamW(model.parameters())
    train_steps(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), 1)
    ck = checkpointer(small_disk / "ck", model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), keep=1)
    with pytest.raises(NoSpace, match=r"no space left on .*ck: the checkpoint of step 1 needs ~\d"):
        ck.save(1, sync=not async_save)
        ck.wait()
    assert not list((small_disk / "ck").glob(".tmp-*"))  # the partial save is gone: the disk has room again
    assert complete_checkpoints(small_disk / "ck") == []
