"""Checkpoints with `torch.distributed.checkpoint` (DCP): async by default, committed atomically.

A checkpoint for step N is written into `ROOT/.tmp-step_0000000N/`; when every rank has written it
(DCP's coordinator writes `.metadata` last), rank 0 writes the `COMPLETE` marker into it (the sha256
of every file, the step, and the run's model and training settings) and renames it to
`ROOT/step_0000000N/`. Each rank hashes its own files while it writes them, in the background
save (`_DigestingWriter`: ~1/128 of a prod checkpoint per rank, not all of it on rank 0), and leaves
the digests in `.sha256.<rank>`; the commit merges those small files and refuses a checkpoint with
a file no rank vouched for. `latest()` considers only directories with the marker, so a crash at any
moment of a save leaves the previous checkpoint as the one to resume from. A committed checkpoint of
the same step is moved aside (`.old-step_N`), not deleted, until the new one is in place.

`restore` checks the files against the marker's sha256, split across the ranks (file i of the sorted
names by rank i % world, whatever world size wrote it; one all_gather for the verdict), and falls
back to the newest checkpoint that verifies, saying so. `supernode.core.checkpoints.checkpoint_problem`
alone checks every file in one process (the restore drill, the export).

What is saved: the training state registered once with the checkpointer (`train_state`: model and
optimizer through `get_model_state_dict` / `get_optimizer_state_dict`, sharded FSDP/TP/EP DTensors
that DCP reshards on load, so a run may resume on another world size or layout; the LR scheduler;
the data loader position), plus every rank's RNG states and the step. Keys are the whole model's
parameter names whatever the layout: a pipeline stage keeps each layer under its global index
(`supernode.trainer.pipeline`), and the optimizer state is flattened to one key per parameter and setting
(no per-rank list of parameter groups), so a run saved at one (pp, dp) resumes at another, pp 1
included. DCP loads each rank's shards
straight into the sharded tensors: a restore never materialises the full model.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from supernode.core.checkpoints import (
    COMPLETE,
    OLD_PREFIX,
    PREFIX,
    TMP_PREFIX,
    TRUST_UNCHECKED_ENV,
    checkpoint_problem,
    complete_checkpoints,
    marker_unchecked,
    read_marker,
    step_dir,
)
from supernode.core.faults import inject

from .divergence import NonFinite
from .log import LOG

DIGESTS = ".sha256."  # `.sha256.<rank>`: the digests of the files one rank wrote, in a save's temporary directory


class CheckpointMismatch(Exception):
    """The latest checkpoint was written for another model (shapes or parameter names differ)."""


class CheckpointCorrupt(Exception):
    """No checkpoint in the directory verifies against its recorded checksums."""


class NoSpace(Exception):
    """A checkpoint could not be written for lack of space: retrying onto the same disk cannot help."""


class MissingDigest(Exception):
    """A save left a file that no rank's digest file covers: it is not committed."""


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state dict, this rank's shards only."""
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", obj)
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc`, its causes and contexts, and the per-rank failures a CheckpointException carries."""
    seen: dict[int, BaseException] = {}
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen[id(e)] = e
        if isinstance(e, CheckpointException):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in e.failures.values())
        todo.extend([e.__cause__, e.__context__])
    return list(seen.values())


def _is_no_space(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _chain(exc))


def _is_write_error(exc: BaseException) -> bool:
    """A failed write without an errno: torch's zip writer reports a full disk as "unexpected pos"."""
    return any(isinstance(e, OSError) or "unexpected pos" in str(e) for e in _chain(exc))


class _Digesting:
    """A checkpoint file being written, hashed on the way: DCP writes each file front to back, so
    the digest is the file's without reading it back (9 GB per rank at prod scale)."""

    def __init__(self, f: Any):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, b: Any) -> int:
        self.sha.update(b)
        return self.f.write(b)

    def writelines(self, lines: Any) -> None:
        for b in lines:
            self.write(b)

    def seek(self, *args: Any) -> int:  # a rewrite would make the digest wrong: fail loudly, never silently
        raise io.UnsupportedOperation("checkpoint files are hashed while written: front to back only")

    truncate = seek

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (for fsync), close
        return getattr(self.f, name)


class _DigestingFileSystem(FileSystem):
    def __init__(self) -> None:
        self.digests: dict[str, str] = {}  # file name -> sha256 of what was written

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        with super().create_stream(path, mode) as f:
            if "w" not in mode:
                yield f
                return
            stream = _Digesting(f)
            yield stream
        self.digests[Path(path).name] = stream.sha.hexdigest()  # only once written and closed


class _DigestingWriter(FileSystemWriter):
    """DCP's file writer, plus: each rank records the sha256 of the files it wrote (`__<rank>_*`) in
    `.sha256.<rank>` once they are written, and the coordinator that of `.metadata` in
    `.sha256.metadata`. DCP finishes on the coordinator only after every rank's write_data has
    returned, so all digest files exist when rank 0 commits: no extra collective, no re-read."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.fs = _DigestingFileSystem()

    def _record(self, who: str) -> None:
        digests, self.fs.digests = self.fs.digests, {}
        with (Path(self.path) / f"{DIGESTS}{who}").open("w", encoding="utf-8") as f:
            json.dump(digests, f)
            f.flush()
            os.fsync(f.fileno())

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        written.wait()  # FileSystemWriter writes synchronously; raises if a write failed
        self._record(str(self.rank))
        return written

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)  # writes `.metadata.tmp`, then renames it `.metadata`
        self.fs.digests = {name.removesuffix(".tmp"): d for name, d in self.fs.digests.items()}
        self._record("metadata")


def _merge_digests(tmp: Path) -> dict[str, str]:
    """The marker's files: every file of a written save with the digest its writer recorded."""
    digests: dict[str, str] = {}
    for part in sorted(tmp.glob(DIGESTS + "*")):
        digests.update(json.loads(part.read_text(encoding="utf-8")))
    files = sorted(p.name for p in tmp.iterdir() if p.is_file() and not p.name.startswith(DIGESTS))
    undigested = [name for name in files if name not in digests]
    if undigested:
        raise MissingDigest(
            f"checkpoint {tmp} not committed: no rank recorded a sha256 for "
            f"{', '.join(undigested)} (its {DIGESTS}<rank> file is missing)"
        )
    return {name: digests[name] for name in files}


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, sd: dict) -> None: ...


class ModelState:
    """The model's sharded state dict as a Stateful (DCP loads into it in place)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd)


class OptimizerState:
    """The optimizer's sharded state dict, keyed by parameter name, as a Stateful. Flattened
    ("state.<name>.exp_avg", "param_groups.<name>.lr"): each pipeline stage saves and loads only
    the keys of its own parameters."""

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        if not self.optimizer.state:  # a restore into a fresh optimizer: DCP loads into these tensors
            zero_adam_state(self.optimizer)
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.OPTIONS)

    def load_state_dict(self, sd: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, sd, options=self.OPTIONS)


@torch.no_grad()
def zero_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Adam's state before its first step, as `Adam._init_group` makes it, in place of torch's own
    initialisation (`state_dict._init_optim_state`: a zero-lr step on zero gradients), which holds
    every parameter's gradient and the step's temporaries beside the moments. That was a restore's
    peak: 8 ranks, EP 8 x FSDP 8, 0.37 B parameters, 0.84x the whole fp32 model per rank (params +
    moments + runtime are 0.64x). Other optimizers keep torch's path."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is one
        return
    for group in optimizer.param_groups:
        on_device = group["fused"] or group["capturable"]
        for p in (p for p in group["params"] if p.requires_grad):
            state = optimizer.state[p]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def train_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Stateful, loader: Stateful
) -> dict[str, Stateful]:
    """What a training run registers with its Checkpointer (the keys are those of the files)."""
    return {
        "model": ModelState(model),
        "optim": OptimizerState(model, optimizer),
        "scheduler": scheduler,
        "data": loader,
    }


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
    """Save / restore the registered training state under `root`, keeping the newest `keep` checkpoints,
    and decide when to save (`maybe_save`). As a context manager it finishes the save in flight on the way
    out, unless the run is failing for a reason (a lost peer) that would hang that save's collectives."""

    def __init__(
        self,
        root: str | Path,
        keep: int,
        state: dict[str, Stateful],
        async_save: bool = True,
        meta: dict | None = None,
        interval: int = 0,
        weights_finite: Callable[[], bool] = lambda: True,
    ):
        """`state`: the Statefuls saved and restored (`train_state(...)`), registered once; the
        checkpointer adds the step and every rank's RNG states.
        `meta` (the model and training settings) is recorded in every checkpoint's marker;
        Rank 0 says (the trainer's log) what restore decided, e.g. a fallback past a corrupt checkpoint,
        and names step directories without a marker, which are kept.
        `interval`: `maybe_save` saves every `interval` steps (0: only at a run's last step or a stop);
        `weights_finite` (collective) is asked before each of its saves: a non-finite state is never written.
        The caller must own the out directory (OutDirLock): start-up removes leftovers of saves."""
        self.root, self.keep, self.async_save = Path(root), keep, async_save
        self.interval, self.weights_finite = interval, weights_finite
        self.last_saved = 0  # the newest step saved or restored
        self.state = state
        self.meta = meta or {}
        self.restored_meta: dict = {}  # the marker of the checkpoint restore() loaded
        self._save_bytes = 0  # estimated size of the save in flight, for a "no space" message
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # A group of its own: the background save runs collectives (plan gather, metadata) that must
        # never interleave with the training loop's collectives on the default group.
        self.group = dist.new_group(backend="gloo")
        self._pending: tuple[int, Future] | None = None
        self._branch: Path | None = None  # a parent run's step to start from (`branch`)
        # Staging (the copy to host memory the background write reads) also runs in a thread, into
        # buffers reused across saves; the loop only waits for it before it next changes the
        # weights (`wait_for_staging`, called before optimizer.step()).
        gpu = torch.cuda.is_available()
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=gpu
            )
        )
        self._staging: Future | None = None
        self.last_stall_s = 0.0  # how long the last save() blocked the caller
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(TMP_PREFIX + "*"):  # interrupted saves of a previous attempt
                shutil.rmtree(stale, ignore_errors=True)
            for old in self.root.glob(OLD_PREFIX + "*"):  # a commit that died between its two renames
                final = self.root / (PREFIX + old.name[len(OLD_PREFIX) :])
                if final.exists():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.replace(old, final)
            # A step directory without its marker (deleted, or lost with a copy) is never resumed from;
            # it may still hold good weights, so it is named and kept, never removed in silence.
            for d in sorted(self.root.glob(PREFIX + "*")):
                if d.is_dir() and not (d / COMPLETE).is_file():
                    LOG.info(
                        f"{d} has no {COMPLETE} marker, so it is not a checkpoint to resume from; kept as it "
                        "is (restore its marker from a copy, or delete it)"
                    )
        dist.barrier(group=self.group)

    # -- saving ----------------------------------------------------------------------------
    def maybe_save(self, step: int, last: bool, stopping: bool, trained: bool = True) -> bool:
        """Save step `step` if it is due: every `interval` steps, the run's last step, or a stop (those two
        written before this returns). Never a step whose update was skipped (`trained` false): its weights
        are an earlier step's, and a periodic save would only rotate good checkpoints out. Raises NonFinite
        rather than write non-finite weights. Returns whether it saved."""
        due = (self.interval and step % self.interval == 0) or last or stopping
        if not (due and trained):
            return False
        if not self.weights_finite():
            raise NonFinite(
                f"step {step}: the weights are not finite; no checkpoint written (the last is step "
                f"{self.last_saved}); lower training.lr, then run again"
            )
        self.save(step, sync=stopping or last)
        return True

    def _state(self, step: int, rng: Any) -> dict:
        return {**{name: obj.state_dict() for name, obj in self.state.items()}, "step": step, "rng": rng}

    def save(self, step: int, sync: bool = False) -> None:
        """Start (async) or do (sync) a save of step `step`. Async: returns once the save is
        planned; call `wait_for_staging()` before the next optimizer step changes the weights."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time
        ranks: list[Any] = [None] * self.world
        dist.all_gather_object(ranks, _rng_state(), group=self.group)
        rng = {"world_size": self.world, "ranks": pickle.dumps(ranks)}
        state = self._state(step, rng)
        self._rank_bytes = _nbytes(state)  # what this rank writes
        self._save_bytes = self._rank_bytes * self.world
        tmp = step_dir(self.root, step, tmp=True)
        try:
            if inject("enospc") == str(step):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            if self.async_save and not sync:
                response = dcp.async_save(
                    state, storage_writer=_DigestingWriter(tmp), process_group=self.group, async_stager=self._stager
                )
                self._staging, self._pending = response.staging_completion, (step, response.upload_completion)
            else:
                dcp.save(state, storage_writer=_DigestingWriter(tmp), process_group=self.group)
                self._commit(step)
        except BaseException as e:  # DCP's CheckpointException is a BaseException, not an Exception
            self._failed(e, step)
            raise
        self.last_stall_s = time.perf_counter() - t0
        self.last_saved = step

    def _failed(self, exc: BaseException, step: int) -> None:
        """A save failed: drop its partial files; a full disk becomes NoSpace (not retryable)."""
        tmp = step_dir(self.root, step, tmp=True)
        # Free space as the failed write saw it: measured after the partial save is gone, a full disk
        # looks roomy and the failure would be retried onto it.
        free = shutil.disk_usage(self.root).free if self.root.exists() else 0
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        # A write error without an errno (torch's zip writer says "unexpected pos") counts as a full
        # disk only when this rank's own part would not fit: other failures (a lost peer) stay
        # retryable, however large the whole checkpoint is.
        if _is_no_space(exc) or (_is_write_error(exc) and free < self._rank_bytes):
            usage = shutil.disk_usage(self.root) if self.root.exists() else None
            room = f" of {usage.total / 1e6:,.0f} MB, {usage.free / 1e6:,.0f} MB free without it" if usage else ""
            raise NoSpace(
                f"no space left on {self.root}: the checkpoint of step {step} needs "
                f"~{self._save_bytes / 1e6:,.1f} MB{room}; free space (or keep fewer checkpoints), "
                "then run again to resume from the last checkpoint"
            ) from None

    def wait_for_staging(self) -> None:
        """Block until the state of the save in flight is copied; call before changing the weights."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def close(self) -> None:
        """Finish the save in flight and free the staging buffers."""
        self.wait()
        self._stager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        # A save in flight on a diverging run is of an earlier, finite step: kept. Any other failure
        # (a lost peer, a timeout) would leave that save's collectives waiting forever.
        if exc is None or isinstance(exc, NonFinite):
            self.close()

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
            try:
                fut.result()  # raises if the write failed: the checkpoint then stays uncommitted
                self._commit(step)
            except BaseException as e:  # CheckpointException included
                self._failed(e, step)
                raise

    def _commit(self, step: int) -> None:
        # DCP's coordinator (rank 0) finishes only after every rank's writes are reported, so
        # rank 0 alone can publish the directory. No collective here: ranks poll at different times.
        if self.rank != 0:
            return
        tmp, final = step_dir(self.root, step, tmp=True), step_dir(self.root, step)
        files = _merge_digests(tmp)
        marker = tmp / COMPLETE
        with marker.open("w", encoding="utf-8") as f:
            json.dump({"step": step, "world_size": self.world, "time": time.time(), "files": files, **self.meta}, f)
            f.flush()
            os.fsync(f.fileno())
        for part in tmp.glob(DIGESTS + "*"):  # merged into the marker
            part.unlink()
        aside = self.root / (OLD_PREFIX + final.name[len(PREFIX) :])
        if final.exists():  # the same step again (a resume from an earlier one, or a leftover): keep it
            os.replace(final, aside)  # until the new one is in place; start-up puts it back after a crash
        os.replace(tmp, final)  # the checkpoint now counts, marker and all, in one rename
        shutil.rmtree(aside, ignore_errors=True)
        for _old_step, old in complete_checkpoints(self.root)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # -- restoring -------------------------------------------------------------------------
    def latest(self) -> tuple[int, Path] | None:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def branch(self, step_dir: Path) -> None:
        """Until this run commits a checkpoint of its own, restore loads `step_dir` (a parent run's
        step: weights, optimizer, data position), and nothing else: no fallback past a corrupt one."""
        self._branch = Path(step_dir)

    def _choose(self) -> tuple[tuple[int, Path] | None, str | None]:
        """The newest checkpoint that verifies, or (None, why none can be used). Collective: every
        rank checks its share of each candidate's files and all take the same verdict."""
        found = [complete_checkpoints(self.root) if self.rank == 0 else None]
        if self.rank == 0 and not found[0] and self._branch is not None:
            found[0] = [(int(self._branch.name[len(PREFIX) :]), self._branch)]
        # Every rank must consider the same checkpoints, as rank 0 lists them.
        dist.broadcast_object_list(found, src=0, group=self.group)
        bad = []
        for step, path in reversed(found[0]):
            verdicts: list[str | None] = [None] * self.world
            dist.all_gather_object(verdicts, checkpoint_problem(path, (self.rank, self.world)), group=self.group)
            why = next((v for v in verdicts if v is not None), None)
            if why is None:
                if marker_unchecked(path):
                    LOG.info(
                        f"checkpoint {path} has no sha256 of its files; used unverified because {TRUST_UNCHECKED_ENV}=1"
                    )
                if bad:
                    LOG.info(f"checkpoint {bad[0]}; resuming from the previous complete checkpoint, step {step}")
                return (step, path), None
            bad.append(f"{path} is corrupt ({why})")
            if len(bad) > 1:
                LOG.info(f"checkpoint {bad[-1]}")
        if bad:
            return None, (
                f"no usable checkpoint in {self.root}: {'; '.join(bad)}; move the corrupt ones away "
                "to start from step 0, or restore them from a copy"
            )
        return None, None

    def restore(self) -> int:
        """Load the newest complete checkpoint that verifies into the registered state; returns its
        step (0: none). Raises CheckpointCorrupt when checkpoints exist but none verifies."""
        picked, error = self._choose()
        if error:
            raise CheckpointCorrupt(error)
        if picked is None:
            return 0
        step, path = picked
        self.restored_meta = read_marker(path)
        theirs, ours = self.restored_meta.get("model"), self.meta.get("model")
        if isinstance(theirs, dict) and isinstance(ours, dict) and theirs != ours:
            diff = ", ".join(
                f"{k} {theirs.get(k)!r} -> {ours.get(k)!r}"
                for k in sorted(set(theirs) | set(ours))
                if theirs.get(k) != ours.get(k)
            )
            raise CheckpointMismatch(
                f"checkpoint {path} was written for another model (model.{diff}); resume it "
                "with the plan that wrote it, or train into another output directory"
            )
        state = self._state(0, {"world_size": 0, "ranks": b""})
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.group)
        except CheckpointException as e:
            first = next(iter(e.failures.values()))[0]
            raise CheckpointMismatch(
                f"checkpoint {path} does not fit this model and optimizer ({type(first).__name__}: "
                f"{str(first).splitlines()[0] if str(first) else ''}); resume it with the plan that wrote it, "
                "or train into another output directory"
            ) from None
        for name, obj in self.state.items():
            obj.load_state_dict(state[name])
        if state["rng"]["world_size"] == self.world:  # per-rank streams only map 1:1 at the same size
            _set_rng_state(pickle.loads(state["rng"]["ranks"])[self.rank])
        self.last_saved = int(state["step"])
        return self.last_saved


__all__ = [
    "Checkpointer",
    "CheckpointMismatch",
    "CheckpointCorrupt",
    "NoSpace",
    "MissingDigest",
    "train_state",
]
