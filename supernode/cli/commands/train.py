"""`supernode train --stack S --local`: the stack's plan, scaled down by its `local` section, trained
for real on CPU with gloo under torchrun (the same trainer the cluster's PyTorchJob runs).

Writes OUT/plan.json, prepares OUT/data from the shipped corpus when it holds no manifest, and
runs `torchrun --standalone --nproc-per-node N --max-restarts R -m trainer.train`. Running it again
with a larger --steps resumes from the checkpoint in OUT/checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..args import add_stack_args, err, stack_from_args
from ...core.errors import BadInput, EXIT_FAILED
from ...core.plan import Plan, build_local_plan


def register(sub) -> None:
    p = sub.add_parser("train", help="train the stack's model locally on CPU (torchrun + gloo)")
    add_stack_args(p)
    p.add_argument("--local", action="store_true", help="run on this machine (the only mode of this command)")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: the stack's local.nproc)")
    p.add_argument("--steps", type=int, default=None, help="stop after this step (default: local training.steps)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: out/train-STACK)")
    p.add_argument("--data", type=Path, default=None, help="prepared data (default: OUT/data from the shipped corpus)")
    p.add_argument("--log-every", type=int, default=5, help="metrics every N steps")
    p.set_defaults(func=run)


def torchrun_command(plan: Plan, plan_path: Path, data: Path, out: Path, steps: int, log_every: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(plan.world_size), "--max-restarts", str(plan.training.max_restarts),
            "-m", "trainer.train", "--plan", str(plan_path), "--data", str(data), "--out", str(out),
            "--steps", str(steps), "--log-every", str(log_every), "--progress", "--plots"]


def run(args) -> int:
    if not args.local:
        raise BadInput("cluster training runs through the PyTorchJob the stack deploys (it reads the plan from "
                       "its ConfigMap); use --local for a CPU run on this machine")
    for flag in ("nproc", "steps", "log_every"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise BadInput(f"--{flag.replace('_', '-')} must be at least 1 (got {value})")
    stack, cfg = stack_from_args(args)
    plan = build_local_plan(stack, cfg, args.nproc)
    steps = args.steps or plan.training.steps
    out = args.out or Path("out") / f"train-{stack}"
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    plan_path.write_text(plan.to_json(), encoding="utf-8")

    from trainer.data import DEFAULT_CORPUS, DataError, prepare, verify  # torch only for this command
    data = args.data or out / "data"
    try:
        if args.data is None and not (data / "manifest.json").exists():
            manifest = prepare(DEFAULT_CORPUS, data, shard_tokens=1 << 16)
            print(f"prepared {manifest['total_tokens']:,} tokens of {', '.join(p.name for p in DEFAULT_CORPUS)} "
                  f"into {len(manifest['shards'])} shards in {data}")
        verify(data)
    except DataError as e:
        raise BadInput(str(e)) from None

    m, d = plan.model, plan.degrees
    print(f"training {stack} (local): {plan.params.total / 1e6:.2f} M parameters ({m.layers} layers, dim {m.dim}, "
          f"{m.experts} experts top-{m.top_k}) on {plan.world_size} CPU processes, dp_shard {d.dp_shard} x tp {d.tp}, "
          f"ep {d.ep}; steps {steps} of {plan.training.steps}, checkpoint every {plan.training.checkpoint_interval}",
          flush=True)
    # A restarted attempt must not read the dead attempt's addresses from a shared rendezvous store
    # (pytorch/pytorch#135712): without this, torchrun's restarts fail to connect.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    rc = subprocess.call(torchrun_command(plan, plan_path, data, out, steps, args.log_every), env=env)
    if rc != 0:
        err.print(f"training failed (torchrun exit {rc}); see the output above", markup=False)
        return EXIT_FAILED
    _summary(out)
    return 0


def _summary(out: Path) -> None:
    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if (out / "metrics.jsonl").exists() else []
    recs = [json.loads(line) for line in lines if line.strip()]
    if recs:
        first, last = recs[0], recs[-1]
        print(f"loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']}); "
              f"{last['tokens_per_s']:,.0f} tokens/s; metrics {out / 'metrics.jsonl'}, plots {out}/loss.png, "
              f"{out}/expert_load.png; checkpoints {out / 'checkpoints'}")
