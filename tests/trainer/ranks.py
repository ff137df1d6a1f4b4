"""Multi-process trainer tests: spawn N gloo ranks, collect what each returns.

Usage: `results = spawn(worker, world_size, tmp_path, *args)` where `worker(rank, world_size, *args)`
is a module-level function (spawned processes import it by name). The process group is already
initialised (gloo, file rendezvous: no ports, safe under pytest-xdist) when `worker` runs; each
rank's return value comes back in a list indexed by rank.

A module of its own, not the conftest: every test directory's conftest is a top-level module named
`conftest`, so `from conftest import spawn` found whichever directory's conftest came first on the
path (a spawned rank, importing its test module afresh, could get tests/tools').
"""

from __future__ import annotations

import logging
import os
import pickle
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from supernode.trainer.log import LOG, setup, write_through


def _entry(rank: int, world_size: int, workdir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)  # the test machine is small and shared
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )  # a hang fails the test instead of CI
    try:
        out = fn(rank, world_size, *args)
        error = None
    except BaseException:  # reported by the parent with the rank's traceback
        out, error = None, traceback.format_exc()
    Path(workdir, f"rank{rank}.pkl").write_bytes(pickle.dumps((out, error)))
    if error is None:
        dist.barrier()
    dist.destroy_process_group()
    if error is not None:
        os._exit(1)  # peers may be blocked in a collective; don't wait for them


def spawn(fn: Callable[..., Any], world_size: int, workdir: Path, *args: Any) -> list[Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        mp.start_processes(
            _entry, args=(world_size, str(workdir), fn, args), nprocs=world_size, start_method="spawn", join=True
        )
    except mp.ProcessExitedException:
        pass  # the per-rank files below say why
    found = {
        rank: pickle.loads(p.read_bytes()) for rank in range(world_size) if (p := workdir / f"rank{rank}.pkl").exists()
    }
    for rank, (_, error) in sorted(found.items()):
        if error is not None:
            raise AssertionError(f"rank {rank} failed:\n{error}")
    missing = sorted(set(range(world_size)) - set(found))
    if missing:
        raise AssertionError(f"ranks {missing} exited without a result (crashed or killed)")
    return [found[rank][0] for rank in range(world_size)]


@contextmanager
def logged(rank: int = 0) -> Iterator[list[str]]:
    """The lines this process's trainer logger prints, configured as a worker of `rank` configures it
    (rank 0 says, the others are quiet)."""
    lines: list[str] = []
    setup(rank)
    write_through(lines.append)
    try:
        yield lines
    finally:
        write_through(None)
        LOG.handlers.clear()
        LOG.propagate = True
        LOG.setLevel(logging.NOTSET)
