"""The training loop, run under torchrun: the Plan decides the model, the layout and the schedule.

    torchrun --nproc-per-node N --max-restarts R -m trainer.train --plan plan.json --data DIR --out DIR

Every start resumes from the latest complete checkpoint in OUT/checkpoints, so when a rank dies and
torchrun restarts the workers (up to --max-restarts, from `training.max_restarts`), the job
continues by itself. `--steps N` stops after step N; the LR schedule always spans the plan's
`training.steps`, so a run stopped and resumed follows the same curve as one that never stopped.
SIGTERM (torchrun forwards it; Kubernetes sends it before eviction) saves a checkpoint and exits.
Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the shared rendezvous store a
restarted attempt reads the failed attempt's addresses and cannot connect (pytorch/pytorch#135712).

Exit codes: 0 done; 1 failure; 2 bad input (plan, data, a plan that does not fit the world size).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from supernode.core.config import Training
from supernode.core.errors import EXIT_BAD_INPUT, BadInput, bad_input_lines
from supernode.core.plan import Plan

from .checkpoint import CheckpointMismatch, Checkpointer
from .data import DataError, TokenLoader
from .metrics import Metrics
from .model import Transformer, loss_fn
from .parallel import ParallelDims, parallelize

BETAS = (0.9, 0.95)


def lr_factor(t: Training) -> Callable[[int], float]:
    """Multiplier of `t.lr` after `step` optimizer steps: linear warmup, then the plan's decay."""
    floor = t.min_lr_ratio

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
        return floor + (1 - floor) * decay

    return factor


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Global gradient norm over every shard, then clip. Parameters live on different meshes
    (dense, experts, router), and DTensor norms only combine within one mesh and placement, so
    the norm is taken per group and the groups' squares are summed."""
    groups: dict = defaultdict(list)
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups[key].append(p.grad)
    total_sq = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += norm.detach().double().cpu() ** 2
    total = math.sqrt(total_sq.item())
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto prints two 'USDT ... profiler_start/stop' lines to fd 2 per session, which would
    flood the log with one profiled step per metrics line; mute fd 2 for just those calls."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class CommClock:
    """Seconds with a collective in flight during a profiled region: the union of the backend's
    collective intervals (gloo worker threads, NCCL kernels) as torch.profiler records them."""

    def __init__(self, enabled: bool, cuda: bool):
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.prof = profile(activities=acts) if enabled else None

    def __enter__(self) -> "CommClock":
        if self.prof is not None:
            with _quiet_stderr():
                self.prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            with _quiet_stderr():
                self.prof.__exit__(*exc)

    def seconds(self) -> float:
        if self.prof is None:
            return 0.0
        spans = sorted((e.time_range.start, e.time_range.end) for e in self.prof.events()
                       if e.name.startswith(("gloo:", "nccl")))
        total, end = 0, -math.inf
        for s, e in spans:
            if e > end:
                total += e - max(s, end)
                end = e
        return total / 1e6


class StopRequest:
    """SIGTERM sets a flag; the loop acts on it at a step boundary, agreed by all ranks."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame) -> None:
        self.requested = True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n")[0])
    p.add_argument("--plan", type=Path, required=True, help="plan JSON (supernode plan --json --full, or the ConfigMap)")
    p.add_argument("--data", type=Path, required=True, help="directory with manifest.json and token shards")
    p.add_argument("--out", type=Path, required=True, help="checkpoints/ and metrics go here")
    p.add_argument("--steps", type=int, default=None, help="stop after this step (default: the plan's steps)")
    p.add_argument("--log-every", type=int, default=1, help="metrics every N steps (those steps are profiled)")
    p.add_argument("--sync-checkpoint", action="store_true", help="blocking saves instead of async")
    p.add_argument("--prometheus-port", type=int, default=None, help="serve /metrics on this port (rank 0)")
    p.add_argument("--progress", action="store_true", help="rich progress bar (rank 0)")
    p.add_argument("--plots", action="store_true", help="PNG plots of loss and expert load at the end")
    return p


def _load_plan(path: Path) -> Plan:
    try:
        return Plan.read(path)
    except FileNotFoundError:
        raise BadInput(f"--plan {path}: file not found") from None
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        raise BadInput(f"--plan {path}: not a valid plan: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def train(args: argparse.Namespace) -> int:
    plan = _load_plan(args.plan)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = torch.cuda.is_available()
    # The core's layout validator, before any collective: a mismatch must not hang. tp stays in a node.
    dims = ParallelDims.from_plan(plan, world, plan.accelerators_per_node if gpu else None)
    t, steps = plan.training, args.steps or plan.training.steps
    if steps < 1:
        raise BadInput(f"--steps must be at least 1 (got {steps})")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("cuda:nccl,cpu:gloo" if gpu else "gloo", timeout=timedelta(seconds=t.collective_timeout_s))
    try:
        return _run(args, plan, dims, steps, device)
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace, plan: Plan, dims: ParallelDims, steps: int, device: torch.device) -> int:
    t = plan.training
    rank, world = dist.get_rank(), dist.get_world_size()
    stop = StopRequest()
    torch.manual_seed(t.seed + rank)
    model = Transformer(plan.model)
    model.init_weights(t.seed)
    model.to(device)
    model = parallelize(model, dims, dims.build_mesh(device.type), plan.parallel, device.type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=BETAS, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(t))
    try:
        loader = TokenLoader(args.data, plan.model.seq_len, t.global_batch, t.micro_batch,
                             dims.dp_rank(rank), dims.dp_size, t.seed)
    except DataError as e:
        raise BadInput(str(e)) from None
    ckpt = Checkpointer(args.out / "checkpoints", keep=t.keep_checkpoints,
                        async_save=t.async_checkpoint and not args.sync_checkpoint)
    try:
        start = ckpt.restore(model, optimizer, scheduler, loader)
    except CheckpointMismatch as e:
        raise BadInput(str(e)) from None
    metrics = Metrics(args.out, plan, world, device.type, rank, args.prometheus_port,
                      progress=args.progress, total_steps=steps, start_step=start)
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        metrics.message("warning: torchrun restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, "
                        "else a restarted attempt reads stale addresses (pytorch/pytorch#135712) and cannot connect")
    metrics.message(f"{'resumed from checkpoint at step ' + str(start) if start else 'starting at step 0'}; "
                    f"training to step {steps} on {world} {device.type} rank(s), layout {plan.degrees.model_dump()}")
    accum = plan.micro_batches_per_step
    gpu = device.type == "cuda"
    tokens_per_step = t.global_batch * plan.model.seq_len
    step = start
    try:
        for step in range(start + 1, steps + 1):
            # Also the first and last steps, so a run always shows where its loss started and ended.
            profiled = step % args.log_every == 0 or step in (start + 1, steps)
            t0 = time.perf_counter()
            micro = loader.next_step()
            data_s = time.perf_counter() - t0
            with CommClock(profiled, gpu) as clock:
                loss_sum = torch.zeros((), device=device)
                load: Optional[torch.Tensor] = None
                for i, mb in enumerate(micro):
                    if hasattr(model, "set_requires_gradient_sync"):  # reduce-scatter once per step
                        model.set_requires_gradient_sync(i == len(micro) - 1)
                    mb = mb.to(device, non_blocking=True)
                    loss = loss_fn(model(mb[:, :-1]), mb[:, 1:])
                    ((loss + model.aux_loss()) / accum).backward()
                    loss_sum += loss.detach()
                    counts = model.expert_load()
                    load = counts if load is None else load + counts
                grad_norm = clip_grad_norm(model.parameters(), t.grad_clip)
                ckpt.wait_for_staging()  # an async save copies the weights while this step computed
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                model.update_router_bias(load)  # the whole step's tokens, however they were split
                # One collective for the global loss and the stop vote, so ranks stop at the same step.
                sync = torch.stack([loss_sum / accum, torch.tensor(float(stop.requested), device=device)])
                dist.all_reduce(sync)
                if gpu:
                    torch.cuda.synchronize(device)
            step_s = time.perf_counter() - t0
            ckpt.poll()
            if profiled:
                comm_s = clock.seconds()
                metrics.log(step, loss=sync[0].item() / world, lr=scheduler.get_last_lr()[0], grad_norm=grad_norm,
                            tokens=tokens_per_step, step_s=step_s, compute_s=max(0.0, step_s - data_s - comm_s),
                            comm_s=comm_s, data_s=data_s, expert_load=load)
            stopping = sync[1].item() > 0
            if step % t.checkpoint_interval == 0 or step == steps or stopping:
                ckpt.save(step, model, optimizer, scheduler, loader, sync=stopping or step == steps)
                metrics.message(f"step {step}: loss {sync[0].item() / world:.4f}; checkpoint "
                                f"{'written' if stopping or step == steps else 'started (async)'}, "
                                f"training blocked {ckpt.last_stall_s * 1e3:.0f} ms")
            if stopping:
                metrics.message(f"SIGTERM: stopped after step {step} with a checkpoint")
                break
        ckpt.close()
    finally:
        metrics.close(plots=args.plots and step == steps)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return train(args)
    except Exception as e:
        lines = bad_input_lines(e)
        if lines is None:
            raise
        print("\n".join(lines), file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
