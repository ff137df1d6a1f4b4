"""The planner's memory per rank against the real thing: build the plan's model and layout, train one step.

    supernode bench memory --stack S [--local] [--nproc N] [--root DIR]

Each of N ranks (gloo on CPU for the local plan; NCCL on GPUs for the full plan) builds the model
sharded from the first byte (`supernode.trainer.parallel.build_model`), runs one forward/backward/AdamW step
on a micro-batch, and prints one JSON line: every term as {"plan": bytes, "measured": bytes}.
- `parameters`, `gradients`, `optimizer_state` (the two Adam moments): bytes of this rank's
  shards, exact on any device.
- `peak_resident_at_build`, `peak_resident_after_step`: the process's peak resident memory (VmHWM)
  less its resident memory before the build (Python and torch themselves). On CPU the plan's
  figure is only its state term at build and its total less the GPU runtime reserve after the
  step (CPU activations are fp32, the plan's bf16 on a bf16 layout): context, not a target.
- on GPU, `allocator_peak`: `torch.cuda.max_memory_allocated` against the plan's total less its
  runtime reserve (the CUDA context and communicator buffers are outside the allocator).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from supernode.core.config import load_stack
from supernode.core.errors import ConfigError
from supernode.core.plan import Plan, build_local_plan, build_plan
from supernode.trainer.memory import local_bytes, resident_bytes


def measure(rank: int, world: int, plan: Plan, device: torch.device) -> dict:
    """Build, one step, the terms (call with the process group initialised)."""
    from supernode.trainer.engine import adamw
    from supernode.trainer.model import loss_fn
    from supernode.trainer.parallel import build_model, checked_layout

    layout = checked_layout(plan, world)
    t, mem = plan.training, plan.memory
    baseline = resident_bytes()
    model = build_model(plan.model, layout, device, t.seed)
    build_peak = resident_bytes("VmHWM") - baseline
    params = local_bytes(model.parameters())
    optimizer = adamw(model, t, device)  # the trainer's own
    tokens = torch.randint(
        0, plan.model.vocab, (t.micro_batch, plan.model.seq_len + 1), generator=torch.Generator().manual_seed(rank)
    ).to(device)
    (loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) + model.aux_loss()).backward()
    grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    optimizer.step()
    moments = local_bytes(v for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    line = {
        "measurement": "memory_per_rank",
        "stack": plan.stack,
        "rank": rank,
        "world_size": world,
        "device": device.type,
        "degrees": plan.degrees.model_dump(),
        "parameters": {"plan": mem.parameters, "measured": params},
        "gradients": {"plan": mem.gradients, "measured": grads},
        "optimizer_state": {"plan": mem.optimizer_state, "measured": moments},
        "peak_resident_at_build": {"plan": mem.parameters, "measured": build_peak},
        "peak_resident_after_step": {
            "plan": mem.total - mem.runtime_reserve,
            "measured": resident_bytes("VmHWM") - baseline,
        },
    }
    if device.type == "cuda":
        torch.cuda.synchronize()
        line["allocator_peak"] = {
            "plan": mem.total - mem.runtime_reserve,
            "measured": torch.cuda.max_memory_allocated(),
        }
    return line


def _worker(rank: int, world: int, workdir: str, plan_json: str, gpu: bool) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "cuda:nccl,cpu:gloo" if gpu else "gloo",
        init_method=f"file://{workdir}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    try:
        line = measure(rank, world, Plan.model_validate_json(plan_json), device)
        Path(workdir, f"rank{rank}.json").write_text(json.dumps(line))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="supernode bench memory", description=__doc__.split("\n")[0])
    ap.add_argument("--stack", required=True)
    ap.add_argument("--root", type=Path, default=Path("."), help="directory holding Pulumi.<stack>.yaml")
    ap.add_argument("--local", action="store_true", help="the stack's local plan, on CPU")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: the plan's world size)")
    args = ap.parse_args(argv)
    try:
        cfg = load_stack(args.stack, args.root)
        plan = build_local_plan(args.stack, cfg, args.nproc) if args.local else build_plan(args.stack, cfg)
    except FileNotFoundError as e:
        print(f"error: --stack {args.stack}: {e.filename} not found", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    gpu = not args.local
    if gpu and torch.cuda.device_count() < plan.world_size:
        print(
            f"error: --stack {args.stack} without --local measures the full plan on {plan.world_size} GPUs; this "
            f"machine has {torch.cuda.device_count()} (give --local for the local plan on CPU)",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(
            _worker,
            args=(plan.world_size, workdir, plan.model_dump_json(), gpu),
            nprocs=plan.world_size,
            start_method="spawn",
            join=True,
        )
        for rank in range(plan.world_size):
            print(Path(workdir, f"rank{rank}.json").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
