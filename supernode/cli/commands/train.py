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

It holds OUT/.lock for the run (a second run on OUT: exit 2 naming the holder); the launcher's process
and its signals are supernode.tools.train_local's.
"""

from __future__ import annotations

from pathlib import Path

from ...core.checkpoints import complete_checkpoints
from ...core.errors import BadInput
from ...core.outdir import OutDirLock
from ...core.plan import build_local_plan
from ...core.runs import prepare_run
from ...tools.train_local import launch
from ..args import add_stack_args, stack_from_args


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
    p.add_argument(
        "--job",
        type=Path,
        default=None,
        metavar="JOB_FILE",
        help="train a job file's run (its training keys over the local run's; `job submit --local` queues one)",
    )
    p.set_defaults(func=run)


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
    if args.job is not None:
        from ...core.jobs import read_job
        from ...tools.jobs_local import local_job_plan

        plan = local_job_plan(stack, cfg, read_job(args.job), args.nproc)
    else:
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
        return launch(stack, plan, plan_path, data, out, steps, args.log_every, LAUNCHER_ENV, choice)
    finally:
        lock.release()
