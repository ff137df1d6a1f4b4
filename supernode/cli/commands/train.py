"""`supernode train --stack S --local`: the stack's plan, scaled down by its `local` section, trained
for real on CPU with gloo under torchrun (the same trainer the cluster's PyTorchJob runs).

Writes OUT/plan.json, prepares OUT/data from the shipped corpus when it holds no manifest, and
runs `torchrun --standalone --nproc-per-node N --max-restarts R -m trainer.train`. Running it again
with a larger --steps resumes from the checkpoint in OUT/checkpoints.

It holds OUT/.lock for the run (a second run on OUT: exit 2 naming the holder), runs torchrun in a
session of its own that dies with this process (PR_SET_PDEATHSIG; the workers die with torchrun),
and forwards SIGINT/SIGTERM to the workers, which finish the step, checkpoint and stop (exit 130).
Workers record a failure a restart cannot fix in OUT/.exit.json and exit 0, so torchrun neither
restarts nor prints a traceback; the exit code is the recorded one.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from ...core.errors import EXIT_FAILED, EXIT_INTERRUPTED, BadInput
from ...core.plan import Plan, build_local_plan
from ..args import add_stack_args, err, stack_from_args


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
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(plan.world_size),
        "--max-restarts",
        str(plan.training.max_restarts),
        "-m",
        "trainer.train",
        "--plan",
        str(plan_path),
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--log-every",
        str(log_every),
        "--progress",
        "--plots",
    ]


def _die_with_parent() -> None:
    """In torchrun, before exec: SIGKILL it when this launcher dies (it runs in its own session, so
    a kill of the launcher's process group would not reach it)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _workers(agent: int) -> list[int]:
    """torchrun's worker processes (its children), or [] before it started them."""
    pids: list[int] = []
    try:
        for task in Path(f"/proc/{agent}/task").iterdir():
            pids += map(int, (task / "children").read_text().split())
    except OSError:
        pass
    return pids


def run(args) -> int:
    if not args.local:
        raise BadInput(
            "cluster training runs through the PyTorchJob the stack deploys (it reads the plan from "
            "its ConfigMap); use --local for a CPU run on this machine"
        )
    for flag in ("nproc", "steps", "log_every"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise BadInput(f"--{flag.replace('_', '-')} must be at least 1 (got {value})")
    stack, cfg = stack_from_args(args)
    plan = build_local_plan(stack, cfg, args.nproc)
    steps = args.steps or plan.training.steps
    out = args.out or Path("out") / f"train-{stack}"
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out} is an existing file, not a directory")

    from trainer.checkpoint import OutDirLock, complete_checkpoints  # torch only for this command
    from trainer.data.manifest import DataError, verify
    from trainer.data.prepare import DEFAULT_CORPUS, prepare
    from trainer.launch import EXIT_FILE, LAUNCHER_ENV

    lock = OutDirLock(out)  # before anything in OUT is written: plan.json belongs to the holder
    holder = lock.acquire()
    if holder is not None:
        raise BadInput(f"--out {out} is in use by another run ({holder}); wait for it to end, or use another --out")
    try:
        done = complete_checkpoints(out / "checkpoints")
        if done and done[-1][0] > steps:
            raise BadInput(
                f"--steps {steps}: the run in {out} is already at step {done[-1][0]}; give --steps above "
                f"{done[-1][0]} to train on, or another --out to start over"
            )
        plan_path = out / "plan.json"
        plan_path.write_text(plan.to_json(), encoding="utf-8")
        data = args.data or out / "data"
        try:
            if args.data is None and not (data / "manifest.json").exists():
                manifest = prepare(DEFAULT_CORPUS, data, shard_tokens=1 << 16)
                print(
                    f"prepared {manifest['total_tokens']:,} tokens of {', '.join(p.name for p in DEFAULT_CORPUS)} "
                    f"into {len(manifest['shards'])} shards in {data}"
                )
            verify(data)
        except DataError as e:
            raise BadInput(str(e)) from None
        (out / EXIT_FILE).unlink(missing_ok=True)
        return _launch(args, stack, plan, plan_path, data, out, steps, LAUNCHER_ENV)
    finally:
        lock.release()


def _launch(args, stack: str, plan: Plan, plan_path: Path, data: Path, out: Path, steps: int, launcher_env: str) -> int:
    m, d = plan.model, plan.degrees
    print(
        f"training {stack} (local): {plan.params.total / 1e6:.2f} M parameters ({m.layers} layers, dim {m.dim}, "
        f"{m.experts} experts top-{m.top_k}) on {plan.world_size} CPU processes, dp_shard {d.dp_shard} x tp {d.tp}, "
        f"ep {d.ep}; steps {steps} of {plan.training.steps}, checkpoint every {plan.training.checkpoint_interval}",
        flush=True,
    )
    # A restarted attempt must not read the dead attempt's addresses from a shared rendezvous store
    # (pytorch/pytorch#135712): without this, torchrun's restarts fail to connect.
    env = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        **{launcher_env: str(os.getpid())},
    )
    # Its own session: a Ctrl-C reaches only this process, which hands it to the workers. Sent to
    # torchrun, it would kill them after a grace period and end in a SignalException traceback.
    proc = subprocess.Popen(
        torchrun_command(plan, plan_path, data, out, steps, args.log_every),
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    forwarded: list[int] = []

    def forward(signum, frame) -> None:
        if not forwarded:
            print(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint", flush=True)
        forwarded.append(signum)
        for pid in _workers(proc.pid) or [proc.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    from trainer.launch import recorded_code

    code = recorded_code(out)
    if code:  # a worker printed why (bad input, full disk, divergence, interrupted)
        return code
    if forwarded and rc == 0:  # stopped by SIGTERM; the worker said at which step
        return EXIT_INTERRUPTED
    if rc != 0:
        err.print(f"training failed (torchrun exit {rc}); see the output above", markup=False)
        return EXIT_FAILED
    _summary(out)
    return 0


def _summary(out: Path) -> None:
    from trainer.metrics import read_records  # a torn last line must not break the summary

    recs = [r for r in read_records(out / "metrics.jsonl") if isinstance(r.get("loss"), (int, float))]
    if recs:
        first, last = recs[0], recs[-1]
        print(
            f"loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']}); "
            f"{last['tokens_per_s']:,.0f} tokens/s; metrics {out / 'metrics.jsonl'}, plots {out}/loss.png, "
            f"{out}/expert_load.png; checkpoints {out / 'checkpoints'}"
        )
