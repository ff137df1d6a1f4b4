"""Checkpoints with `torch.distributed.checkpoint` (DCP): async by default, committed atomically.

A checkpoint for step N is written into `ROOT/.tmp-step_0000000N/`; when every rank has written it
(DCP's coordinator writes `.metadata` last), rank 0 renames it to `ROOT/step_0000000N/` and only
then writes the `COMPLETE` marker inside it. `latest()` considers only directories with the marker,
so a crash at any moment of a save leaves the previous checkpoint as the one to resume from.

What is saved: model and optimizer through `get_state_dict` (sharded: FSDP/TP/EP DTensors, which DCP
reshards on load, so a run may resume on another world size or layout), the LR scheduler, the data
loader position, every rank's RNG states and the step.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

COMPLETE = "COMPLETE"
PREFIX, TMP_PREFIX = "step_", ".tmp-step_"


class CheckpointMismatch(Exception):
    """The latest checkpoint was written for another model (shapes or parameter names differ)."""


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, sd: dict) -> None: ...


def _step_dir(root: Path, step: int, tmp: bool = False) -> Path:
    return root / f"{TMP_PREFIX if tmp else PREFIX}{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint, oldest first."""
    root = Path(root)
    found = []
    for d in root.glob(PREFIX + "*") if root.is_dir() else []:
        if (d / COMPLETE).is_file() and d.name[len(PREFIX):].isdigit():
            found.append((int(d.name[len(PREFIX):]), d))
    return sorted(found)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Save / restore the training state under `root`, keeping the newest `keep` checkpoints."""

    def __init__(self, root: str | Path, keep: int, async_save: bool = True):
        self.root, self.keep, self.async_save = Path(root), keep, async_save
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # A group of its own: the background save runs collectives (plan gather, metadata) that must
        # never interleave with the training loop's collectives on the default group.
        self.group = dist.new_group(backend="gloo")
        self._pending: tuple[int, Future] | None = None
        # Staging (the copy to host memory the background write reads) also runs in a thread, into
        # buffers reused across saves; the loop only waits for it before it next changes the
        # weights (`wait_for_staging`, called before optimizer.step()).
        gpu = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                    use_async_staging=True, use_non_blocking_copy=gpu))
        self._staging: Future | None = None
        self.last_stall_s = 0.0  # how long the last save() blocked the caller
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(TMP_PREFIX + "*"):  # interrupted saves of a previous attempt
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier(group=self.group)

    # -- saving ----------------------------------------------------------------------------
    def _state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Stateful,
               loader: Stateful, step: int, rng: Any) -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(),
                "data": loader.state_dict(), "step": step, "rng": rng}

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Stateful,
             loader: Stateful, sync: bool = False) -> None:
        """Start (async) or do (sync) a save of step `step`. Async: returns once the save is
        planned; call `wait_for_staging()` before the next optimizer step changes the weights."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time
        ranks: list[Any] = [None] * self.world
        dist.all_gather_object(ranks, _rng_state(), group=self.group)
        rng = {"world_size": self.world, "ranks": pickle.dumps(ranks)}
        state = self._state(model, optimizer, scheduler, loader, step, rng)
        tmp = _step_dir(self.root, step, tmp=True)
        if self.async_save and not sync:
            response = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group, async_stager=self._stager)
            self._staging, self._pending = response.staging_completion, (step, response.upload_completion)
        else:
            dcp.save(state, checkpoint_id=tmp, process_group=self.group)
            self._commit(step)
        self.last_stall_s = time.perf_counter() - t0

    def wait_for_staging(self) -> None:
        """Block until the state of the save in flight is copied; call before changing the weights."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def close(self) -> None:
        """Finish the save in flight and free the staging buffers."""
        self.wait()
        self._stager.close()

    def poll(self) -> None:
        """Commit a finished async save (cheap; call once per step)."""
        if self._pending is not None and self._pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is written, then commit it."""
        self.wait_for_staging()
        if self._pending is not None:
            step, fut = self._pending
            self._pending = None
            fut.result()  # raises if the write failed: the checkpoint then stays uncommitted
            self._commit(step)

    def _commit(self, step: int) -> None:
        # DCP's coordinator (rank 0) finishes only after every rank's writes are reported, so
        # rank 0 alone can publish the directory.
        if self.rank != 0:
            return
        tmp, final = _step_dir(self.root, step, tmp=True), _step_dir(self.root, step)
        if final.exists():  # an uncommitted leftover (crash between rename and marker)
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker = final / (COMPLETE + ".tmp")
        with marker.open("w", encoding="utf-8") as f:
            json.dump({"step": step, "world_size": self.world, "time": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker, final / COMPLETE)  # written last: the checkpoint now counts
        for old_step, old in complete_checkpoints(self.root)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for d in self.root.glob(PREFIX + "*"):  # uncommitted leftovers older than this one
            if not (d / COMPLETE).exists() and d.name[len(PREFIX):].isdigit() and int(d.name[len(PREFIX):]) < step:
                shutil.rmtree(d, ignore_errors=True)

    # -- restoring -------------------------------------------------------------------------
    def latest(self) -> tuple[int, Path] | None:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Stateful,
                loader: Stateful) -> int:
        """Load the latest complete checkpoint into the given objects; returns its step (0: none)."""
        # Every rank must pick the same checkpoint even if rank 0 commits one meanwhile.
        choice = [self.latest() if self.rank == 0 else None]
        dist.broadcast_object_list(choice, src=0, group=self.group)
        if choice[0] is None:
            return 0
        step, path = choice[0]
        state = self._state(model, optimizer, scheduler, loader, 0, {"world_size": 0, "ranks": b""})
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.group)
        except CheckpointException as e:
            first = next(iter(e.failures.values()))[0]
            raise CheckpointMismatch(
                f"checkpoint {path} does not fit this model and optimizer ({type(first).__name__}: "
                f"{str(first).splitlines()[0] if str(first) else ''}); resume it with the plan that wrote it, "
                "or train into another output directory") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["data"])
        if state["rng"]["world_size"] == self.world:  # per-rank streams only map 1:1 at the same size
            _set_rng_state(pickle.loads(state["rng"]["ranks"])[self.rank])
        return int(state["step"])


__all__ = ["Checkpointer", "CheckpointMismatch", "complete_checkpoints", "COMPLETE"]
