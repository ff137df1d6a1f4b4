"""The profiler's cost: a trainer step under `CommClock` (torch.profiler, how the trainer measures
exposed communication on its sampled steps) against the same step unprofiled, in the same processes.

    supernode bench profiler --stack S [--root DIR] [--nproc N] [--reps R]

The stack's local plan on N gloo ranks (CPU): the trainer's own `Trainer` (model, optimizer, data
loader), then R repetitions of one unprofiled and one profiled step, their order alternating so
machine noise hits both alike; each step's time is the slowest rank's. One JSON line:
`ratio_profiled_vs_not` is the median of the repetition-by-repetition ratios, and
`run_overhead_at_profile_every` what profiling one step in N costs the run, (ratio - 1) / N, at every
step (N 1, what the trainer did before issue 39) and at the cluster job's `PROFILE_EVERY`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from supernode.core.config import load_stack
from supernode.core.errors import ConfigError
from supernode.core.observability import PROFILE_EVERY
from supernode.core.plan import Plan, build_local_plan


def _step_seconds(trainer, profiled: bool) -> float:
    from supernode.trainer.comm_clock import CommClock

    dist.barrier()
    start = time.perf_counter()
    with CommClock(profiled, cuda=False) as clock:
        trainer.train_step(trainer.loader.next_step(), False, False)
    clock.seconds()  # the trace is read on a profiled step too: part of its cost
    took = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step is as long as its slowest rank
    return float(took)


def _worker(rank: int, world: int, workdir: str, plan_json: str, data: str, reps: int) -> None:
    from supernode.trainer.engine import Trainer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    try:
        trainer = Trainer(
            Plan.model_validate_json(plan_json),
            torch.device("cpu"),
            Path(data),
            Path(workdir),
            False,
        )
        _step_seconds(trainer, False)  # warm-up: the first step allocates the optimizer state
        _step_seconds(trainer, True)
        plain, profiled = [], []
        for rep in range(reps):
            for on in (False, True) if rep % 2 == 0 else (True, False):
                (profiled if on else plain).append(_step_seconds(trainer, on))
        if rank == 0:
            Path(workdir, "times.json").write_text(json.dumps({"plain": plain, "profiled": profiled}))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="supernode bench profiler", description=__doc__.split("\n")[0])
    ap.add_argument("--stack", required=True)
    ap.add_argument("--root", type=Path, default=Path("."), help="directory holding Pulumi.<stack>.yaml")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: the stack's local.nproc)")
    ap.add_argument("--reps", type=int, default=10, help="pairs of steps, profiled and not (default 10)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        print(f"error: --reps must be at least 1 (got {args.reps})", file=sys.stderr)
        return 2
    try:
        plan = build_local_plan(args.stack, load_stack(args.stack, args.root), args.nproc)
    except FileNotFoundError as e:
        print(f"error: --stack {args.stack}: {e.filename} not found", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

    with tempfile.TemporaryDirectory() as workdir:
        data = Path(workdir) / "data"
        prepare(DEFAULT_CORPUS, data, shard_tokens=1 << 16)
        world = plan.world_size
        mp.start_processes(
            _worker,
            args=(world, workdir, plan.model_dump_json(), str(data), args.reps),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        times = json.loads(Path(workdir, "times.json").read_text())
    ratio = statistics.median(p / q for p, q in zip(times["profiled"], times["plain"]))
    line = {
        "measurement": "profiler_overhead",
        "stack": plan.stack,
        "world_size": world,
        "device": "cpu",
        "reps": args.reps,
        "step_s_plain": statistics.median(times["plain"]),
        "step_s_profiled": statistics.median(times["profiled"]),
        "ratio_profiled_vs_not": ratio,
        "run_overhead_at_profile_every": {str(n): (ratio - 1) / n for n in (1, PROFILE_EVERY)},
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
