"""`supernode train --stack S --local`: the stack's plan, scaled down by its `local` section, trained
for real on CPU with gloo under torchrun (the same trainer the cluster's PyTorchJob runs).

Writes OUT/plan.json, prepares OUT/data from the shipped corpus when it holds no manifest, and
runs `python -m supernode.trainer.launch --standalone --nproc-per-node N --max-restarts R -m supernode.trainer.train`:
torchrun under the cluster's own launcher, whose exit code is the run's outcome (a failure the
workers recorded: 2 bad input, 1 failed). Running it again with a larger --steps resumes the latest
run (OUT/runs/<run id>/, supernode.core.runs) from its newest checkpoint; `--run new` (or a new NAME)
starts a fresh run, `--run NAME --from-run R --step N` one that starts from run R's step N. This
command picks the run (a fresh id resolved here, once) and passes it to the workers as `--run-id ID`,
so a restarted worker resumes that run instead of starting another.

It holds OUT/.lock for the run (a second run on OUT: exit 2 naming the holder), runs the launcher
in a session of its own that dies with this process (PR_SET_PDEATHSIG; the workers die with it),
and forwards SIGINT/SIGTERM to it: torchrun hands the signal to the workers, which finish the step,
checkpoint and stop; in start-up, the run just stops. Either way exit 130, no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ...core.checkpoints import complete_checkpoints
from ...core.errors import EXIT_FAILED, EXIT_INTERRUPTED, BadInput
from ...core.outdir import OutDirLock
from ...core.plan import Plan, build_local_plan
from ...core.processes import die_with_parent
from ...core.runs import prepare_run
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
    p.add_argument(
        "--run",
        default=None,
        help="the run to resume, 'new' for a fresh run with a generated id, or a fresh run's name (default: the "
        "latest run in OUT/runs)",
    )
    p.add_argument(
        "--from-run", default=None, help="start the new run from this run's --step (weights, optimizer, data)"
    )
    p.add_argument("--step", type=int, default=None, help="with --from-run: the step to start from")
    p.set_defaults(func=run)


def launch_command(
    plan: Plan, plan_path: Path, data: Path, out: Path, steps: int, log_every: int, run: str
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "supernode.trainer.launch",
        "--standalone",
        "--nproc-per-node",
        str(plan.world_size),
        "--max-restarts",
        str(plan.training.max_restarts),
        "-m",
        "supernode.trainer.train",
        "--plan",
        str(plan_path),
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--run-id",
        run,
        "--log-every",
        str(log_every),
        "--progress",
        "--plots",
    ]


def _child_setup() -> None:
    """In supernode.trainer.launch, before exec: SIGKILL it when this process dies (it runs in its own session,
    so a kill of this process group would not reach it), and hold SIGINT/SIGTERM blocked until it
    has its handlers: a signal forwarded during Python's start-up then waits instead of becoming a
    KeyboardInterrupt traceback (or being lost)."""
    die_with_parent()
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))


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

    from supernode.core.runs import NEW, new_run_id
    from supernode.trainer.data.manifest import DataError, verify
    from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare
    from supernode.trainer.launch import LAUNCHER_ENV

    lock = OutDirLock(out)  # before anything in OUT is written: plan.json belongs to the holder
    holder = lock.acquire()
    if holder is not None:
        raise BadInput(f"--out {out} is in use by another run ({holder}); wait for it to end, or use another --out")
    try:
        # A fresh id is chosen here, once: the workers (and any restart of them) get it as --run-id ID.
        run = new_run_id() if args.run == NEW or (args.from_run is not None and args.run is None) else args.run
        if args.step is not None and args.from_run is not None and args.step > steps:  # before a run is made
            raise BadInput(f"--steps {steps}: below --step {args.step}, where the new run starts; give more --steps")
        choice = prepare_run(out, stack, plan.model.model_dump(mode="json"), run, args.from_run, args.step)
        done = complete_checkpoints(choice.checkpoints)
        at = done[-1][0] if done else choice.record["parent"]["step"] if choice.parent_step is not None else 0
        if at > steps:
            raise BadInput(
                f"--steps {steps}: run {choice.run} in {out} is already at step {at}; give --steps above "
                f"{at} to train on, or start a fresh run (--run new)"
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
        return _launch(args, stack, plan, plan_path, data, out, steps, LAUNCHER_ENV, choice)
    finally:
        lock.release()


def _launch(
    args, stack: str, plan: Plan, plan_path: Path, data: Path, out: Path, steps: int, launcher_env: str, choice
) -> int:
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
        **{launcher_env: str(os.getpid())},  # the lock's holder: this process, on the run's behalf
    )
    started: list[subprocess.Popen] = []
    forwarded: list[int] = []

    def forward(signum, frame) -> None:
        if not forwarded:
            print(
                f"\n{signal.Signals(signum).name}: stopping (a step under way is finished and checkpointed)", flush=True
            )
        forwarded.append(signum)
        for proc in started:
            proc.send_signal(signum)

    # Installed before the launcher starts, so no moment drops a signal: one that comes before it
    # exists is sent as soon as it does (it waits, blocked, until supernode.trainer.launch can take it).
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Its own session: a Ctrl-C reaches only this process, which hands it to supernode.trainer.launch
        # (torchrun's agent), which hands it to the workers once they run.
        proc = subprocess.Popen(
            launch_command(plan, plan_path, data, out, steps, args.log_every, choice.run),
            env=env,
            start_new_session=True,
            preexec_fn=_child_setup,
        )
        started.append(proc)
        if forwarded:
            proc.send_signal(forwarded[-1])
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if rc < 0:  # killed by a signal supernode.trainer.launch does not handle (SIGKILL: out of memory?)
        err.print(f"training was killed by signal {-rc} ({signal.strsignal(-rc)})", markup=False)
        return EXIT_FAILED
    if rc >= 128:  # supernode.trainer.launch stopped on a signal (exit 128 + it): interrupted, whichever
        return EXIT_INTERRUPTED
    if rc == 0:
        _summary(choice.dir, plan, choice.checkpoints)
    return rc  # else a worker or torchrun printed why (2 bad input; 1 a failure)


def _summary(out: Path, plan: Plan, checkpoints: Path | None = None) -> None:
    """`out`: the run's directory (its metrics and plots); `checkpoints`: its checkpoints."""
    from supernode.trainer.metrics import read_records  # a torn last line must not break the summary

    records = read_records(out / "metrics.jsonl")
    recs = [r for r in records if isinstance(r.get("loss"), (int, float))]
    # A step whose update was skipped (non-finite) has no loss: the summary must not hide it.
    skipped = sum(1 for r in records if r.get("skipped"))
    note = f"{skipped} non-finite step(s) skipped; " if skipped else ""
    if recs:
        first, last = recs[0], recs[-1]
        print(
            f"loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']}); {note}"
            f"{last['tokens_per_s']:,.0f} tokens/s; metrics {out / 'metrics.jsonl'}, plots {out}/loss.png, "
            f"{out}/expert_load.png; checkpoints {checkpoints or out / 'checkpoints'}"
        )
        # The median step (the first one compiles and warms up) next to the plan's estimate: the same
        # ratio the trainer exports as supernode_train_step_time_over_plan for the drift alarm.
        timed = [r["step_s"] for r in recs if isinstance(r.get("step_s"), (int, float))]
        if not timed:
            return
        steps = sorted(timed[1:] or timed)
        measured = steps[len(steps) // 2]
        print(
            f"step time {measured:.3g} s measured (median) vs {plan.step.step_s:.3g} s planned: "
            f"x{measured / plan.step.step_s:.2f} of the plan"
            + (" (the local CPU run is not the plan's hardware)" if plan.local else "")
        )
