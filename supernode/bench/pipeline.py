"""Pipeline schedules on CPU: step time and the measured bubble, 1F1B vs interleaved 1F1B, beside the planner.

    python -m supernode.bench.pipeline [--pp 4 --micro-batches 8 --layers 8 --dim 256 --steps 4]

`--pp` gloo ranks each run their stages of `supernode.trainer.pipeline` (one stage per rank for 1F1B, two
for interleaved 1F1B) over `--micro-batches` micro-batches per step. The bubble is measured from
the profiler: every stage's forward and backward of a micro-batch is a recorded span, and a rank's
idle fraction is 1 - (the union of its spans) / (the step's span), the mean over the measured steps;
the planner predicts (pp-1)/(m*v + pp-1) (`supernode.core.capacity.bubble_fraction`). On a small
shared CPU the ranks also compete for cores, which stretches spans and step times alike: compare
the schedules' ratios more than the absolute figures. One JSON line per schedule, then a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function

from supernode.core.capacity import bubble_fraction
from supernode.core.config import Model, Parallel
from supernode.trainer.model import loss_fn
from supernode.trainer.pipeline import build_pipeline
from supernode.trainer.train import _quiet_stderr  # Kineto's two "USDT" lines per profiled step

SCHEDULES = (("1f1b", 1), ("interleaved1f1b", 2))
SPAN = "bench.stage"  # the profiler label of one stage's forward or backward of one micro-batch


def _model(args: argparse.Namespace) -> Model:
    return Model(
        layers=args.layers,
        dim=args.dim,
        heads=4,
        kv_heads=2,
        experts=4,
        top_k=2,
        expert_hidden=args.dim,
        dense_hidden=2 * args.dim,
        vocab=256,
        seq_len=args.seq,
    )


def _recorded(stage) -> None:
    """Wrap a PipelineStage's per-micro-batch work in profiler spans."""
    for name in ("forward_one_chunk", "backward_one_chunk"):
        inner = getattr(stage, name)

        def wrapped(*a, _inner=inner, **kw):
            with record_function(SPAN):
                return _inner(*a, **kw)

        setattr(stage, name, wrapped)


def _union_us(spans: list[tuple[int, int]]) -> float:
    total, end = 0, -1
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _worker(rank: int, world: int, workdir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    cfg = _model(args)
    out = {}
    try:
        for schedule, virtual in SCHEDULES:
            parallel = Parallel(pp=world, pp_schedule=schedule, pp_virtual_stages=virtual, mixed_precision="fp32")
            pipe = build_pipeline(cfg, parallel, torch.device("cpu"), 0, args.micro_batch, args.micro_batches, loss_fn)
            stages = getattr(pipe.schedule, "_stages", None) or [pipe.schedule._stage]
            for stage in stages:
                _recorded(stage)
            tokens = torch.randint(
                0,
                cfg.vocab,
                (args.micro_batch * args.micro_batches, cfg.seq_len + 1),
                generator=torch.Generator().manual_seed(0),
            )
            steps, idle = [], []
            for i in range(args.warmup + args.steps):
                dist.barrier()
                prof = profile(activities=[ProfilerActivity.CPU])
                with _quiet_stderr():
                    prof.__enter__()
                t0 = time.perf_counter()
                with record_function("bench.step"):
                    pipe.step(tokens)
                wall = time.perf_counter() - t0
                with _quiet_stderr():
                    prof.__exit__(None, None, None)
                for p in pipe.parts.parameters():
                    p.grad = None
                if i < args.warmup:
                    continue
                events = prof.events()
                step = next(e for e in events if e.name == "bench.step").time_range
                busy = _union_us([(e.time_range.start, e.time_range.end) for e in events if e.name == SPAN])
                steps.append(wall)
                idle.append(1 - busy / max(1, step.end - step.start))
            out[schedule] = {"step_s": statistics.median(steps), "idle": statistics.mean(idle)}
            del pipe
        Path(workdir, f"rank{rank}.pkl").write_bytes(pickle.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supernode.bench.pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (processes)")
    p.add_argument("--micro-batches", type=int, default=8, help="per step (a multiple of --pp)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--layers", type=int, default=8, help="at least 2 x --pp (interleaved: 2 stages per rank)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="measured steps per schedule")
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    if args.pp < 2 or args.layers < 2 * args.pp or args.micro_batches < args.pp or args.micro_batches % args.pp:
        print(
            f"error: need --pp >= 2, --layers >= 2*pp and --micro-batches a multiple of pp (got pp {args.pp}, "
            f"layers {args.layers}, micro-batches {args.micro_batches})",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as workdir:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.start_processes(_worker, args=(args.pp, workdir, args), nprocs=args.pp, start_method="spawn", join=True)
        ranks = [pickle.loads(Path(workdir, f"rank{r}.pkl").read_bytes()) for r in range(args.pp)]
    lines = []
    for schedule, virtual in SCHEDULES:
        idle = [r[schedule]["idle"] for r in ranks]
        line = {
            "bench": "pipeline",
            "schedule": schedule,
            "pp": args.pp,
            "virtual_stages": virtual,
            "micro_batches": args.micro_batches,
            "step_s": round(max(r[schedule]["step_s"] for r in ranks), 4),
            "bubble_measured": round(statistics.mean(idle), 4),
            "bubble_measured_max": round(max(idle), 4),
            "bubble_planned": round(bubble_fraction(args.pp, args.micro_batches, virtual), 4),
        }
        lines.append(line)
        print(json.dumps(line), flush=True)
    one, inter = lines
    print(
        json.dumps(
            {
                "bench": "pipeline",
                "summary": True,
                "step_interleaved_over_1f1b": round(inter["step_s"] / one["step_s"], 3),
                "bubble_measured_interleaved_over_1f1b": round(inter["bubble_measured"] / one["bubble_measured"], 3),
                "bubble_planned_interleaved_over_1f1b": round(inter["bubble_planned"] / one["bubble_planned"], 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
