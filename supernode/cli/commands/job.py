"""`supernode job`: training jobs of a stack (issue 36), beside the one `pulumi up` keeps.

`job plan` builds a job's plan against the stack's hardware with the stack's planner and says whether
it may be submitted, without submitting. `submit | list | describe | logs | cancel` are one API over two
backends: the cluster's (supernode.tools.jobs_cluster: the PyTorchJob in the team's namespace, applied
with the Kubernetes client, its queue state from Kueue) and, with `--local`, this machine's
(supernode.tools.jobs_local: a SQLite store in --home and one runner admitting jobs by priority into
its process slots, preempting a lower one by SIGTERM). Both print the same `JobStatus`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ...core.errors import EXIT_FAILED, BadInput
from ...core.jobs import FINAL_STATES, JobStatus, job_plan, read_job, refusals
from ..args import add_stack_args, plain_console, stack_from_args
from .plan import plan_json, render

DEFAULT_HOME = Path("out/jobs")


def register(sub) -> None:
    job = sub.add_parser("job", help="training jobs of the stack: plan, submit, list, describe, logs, cancel")
    jobs = job.add_subparsers(dest="job_command", required=True, metavar="COMMAND")

    def command(name: str, help: str, func, stack_required: bool = True):
        p = jobs.add_parser(name, help=help)
        add_stack_args(p, required=stack_required)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        return p

    def backend_args(p, local_help: str = "this machine's queue (--home) instead of the cluster's") -> None:
        p.add_argument("--local", action="store_true", help=local_help)
        p.add_argument("--home", type=Path, default=DEFAULT_HOME, help=f"the local queue (default: {DEFAULT_HOME})")
        p.add_argument(
            "--kubeconfig", type=Path, default=None, help="the cluster's kubeconfig (default: ~/.kube/config)"
        )
        p.add_argument("--context", default=None, help="the kubeconfig context (default: its current one)")

    p = command(
        "plan",
        "a job file's plan on the stack's hardware and every figure that would refuse it (exit 1); "
        "nothing is submitted",
        run_plan,
    )
    p.add_argument("job_file", type=Path, metavar="JOB_FILE", help="the job file (YAML: name, team, priority, ...)")
    p.add_argument("--local", action="store_true", help="the job's local run (the stack's local section) instead")

    p = command("submit", "plan a job file and queue it (refused, exit 1, when its plan is)", run_submit)
    p.add_argument("job_file", type=Path, metavar="JOB_FILE")
    backend_args(p)
    p.add_argument(
        "--dry-run", type=Path, default=None, metavar="DIR", help="write the manifests to DIR instead of applying them"
    )

    p = command(
        "list",
        "the stack's jobs: state, queue position and wait, step against the plan",
        run_list,
        stack_required=False,
    )
    backend_args(p)
    p.add_argument("--team", default=None, help="only this team's jobs")

    for name, func, text in (
        ("describe", run_describe, "one job: its queue state, nodes, step, loss, tokens/s, checkpoint, lineage"),
        ("logs", run_logs, "a job's log (rank 0 on the cluster)"),
        ("cancel", run_cancel, "stop a job for good: it checkpoints first (its grace period)"),
    ):
        p = command(name, text, func, stack_required=False)
        p.add_argument("name", metavar="NAME", help="the job's name")
        backend_args(p)
        p.add_argument("--team", default=None, help="the job's team (cluster: where two teams share a name)")
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")

    p = command(
        "wait",
        "wait until jobs reach a state (the demo's and scripts' synchronisation)",
        run_wait,
        stack_required=False,
    )
    p.add_argument("names", nargs="+", metavar="NAME")
    backend_args(p)
    p.add_argument("--team", default=None)
    p.add_argument("--state", default="done", help="done (any end: default), or a state such as running")
    p.add_argument("--step", type=int, default=None, help="with --state running: until its metrics reach this step")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds (exit 1)")

    p = jobs.add_parser("runner", help="(local) the runner that admits, runs and preempts the local jobs")
    p.add_argument("--home", type=Path, default=DEFAULT_HOME)
    p.add_argument("--linger", type=float, default=2.0, help="seconds to stay once nothing is queued or running")
    p.set_defaults(func=run_runner)


def run_plan(args) -> int:
    stack, cfg = stack_from_args(args)
    job = read_job(args.job_file)
    plan = _job_plan(args, stack, cfg, job)
    refused = refusals(plan)
    if args.json:
        print(
            json.dumps(
                {
                    "job": job.model_dump(by_alias=True, mode="json", exclude_defaults=True),
                    "submittable": not refused,
                    "refusals": refused,
                    "plan": plan_json(plan),
                },
                indent=2,
            )
        )
    else:
        console = plain_console()
        console.print(
            f"job {job.name} (team {job.team}, priority {job.priority}) on stack {stack}: "
            f"{plan.nodes} x {plan.instance_type}, world {plan.world_size}",
            markup=False,
        )
        render(plan, console)
        _print_refusals(refused, console)
        if not refused:
            console.print("[green]the job fits its hardware and its grace period: it may be submitted[/]")
    return EXIT_FAILED if refused else 0


def _job_plan(args, stack: str, cfg, job):
    if args.local:
        from ...tools.jobs_local import local_job_plan

        return local_job_plan(stack, cfg, job)
    return job_plan(stack, cfg, job, root=args.root)


def _print_refusals(refused: list[str], console) -> None:
    for line in refused:
        console.print(f"[red]refused: {line}[/]", markup=True, highlight=False)


def _backend(args):
    if args.local:
        from ...tools.jobs_local import LocalBackend

        return LocalBackend(args.home)
    from ...tools.jobs_cluster import ClusterBackend

    if args.stack is None and args.config is None:
        raise BadInput("the cluster's jobs are the stack's: give --stack S (or --config FILE), or --local")
    stack, cfg = stack_from_args(args)
    return ClusterBackend(stack, cfg, kubeconfig=args.kubeconfig, context=args.context)


def run_submit(args) -> int:
    stack, cfg = stack_from_args(args)
    job = read_job(args.job_file)
    if args.local and args.dry_run is not None:
        raise BadInput("--dry-run writes a cluster's manifests; the local queue has none (drop --local)")
    plan = _job_plan(args, stack, cfg, job)
    refused = refusals(plan)
    if args.local:
        from ...tools.jobs_local import LocalBackend

        if not refused:
            status = LocalBackend(args.home).submit(job, plan, args.job_file, stack_args(args))
    else:
        from ...tools.jobs_cluster import ClusterBackend

        if not refused:
            backend = ClusterBackend(stack, cfg, kubeconfig=args.kubeconfig, context=args.context)
            status = backend.submit(job, plan, dry_run=args.dry_run)
    if refused:
        if args.json:
            print(json.dumps({"job": job.name, "submitted": False, "refusals": refused}, indent=2))
        else:
            console = plain_console()
            console.print(f"job {job.name} is not submitted:", markup=False)
            _print_refusals(refused, console)
        return EXIT_FAILED
    if args.json:
        print(status.model_dump_json(indent=2))
    else:
        print(f"job {status.name} (team {status.team}, priority {status.priority}): {status.state}. {status.message}")
    return 0


def stack_args(args) -> list[str]:
    """The flags that name the job's stack again, for the process that runs it (the local runner)."""
    if args.config is not None:
        return ["--config", str(args.config.resolve())]
    return ["--stack", args.stack, "--root", str(args.root.resolve())]


def run_list(args) -> int:
    statuses = _backend(args).list(team=args.team)
    if args.json:
        print(json.dumps([s.model_dump(mode="json") for s in statuses], indent=2))
        return 0
    print_table(statuses)
    return 0


def print_table(statuses: list[JobStatus]) -> None:
    from rich.table import Table

    table = Table(title=f"{len(statuses)} job(s)", title_justify="left")
    for col in ("name", "team", "priority", "state", "queue", "waited", "nodes", "step", "loss", "tokens/s", "ckpt"):
        table.add_column(
            col, justify="right" if col in ("queue", "waited", "nodes", "step", "loss", "tokens/s", "ckpt") else "left"
        )
    for s in statuses:
        table.add_row(
            s.name,
            s.team,
            s.priority,
            s.state + (f" ({s.preemptions} preempted)" if s.preemptions else ""),
            "" if s.queue_position is None else f"#{s.queue_position}",
            "" if s.waited_s is None else f"{s.waited_s:.1f} s",
            str(s.nodes) if s.nodes else "",
            "" if s.step is None else f"{s.step}/{s.steps}",
            "" if s.loss is None else f"{s.loss:.3f}",
            "" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}",
            "" if s.last_checkpoint is None else str(s.last_checkpoint),
        )
    plain_console(width=None if sys.stdout.isatty() else 160).print(table)


def describe_lines(s: JobStatus) -> list[str]:
    lines = [f"job {s.name}: team {s.team}, priority {s.priority}, {s.backend} backend", f"  state      {s.state}"]
    if s.message:
        lines.append(f"  why        {s.message}")
    if s.queue_position is not None:
        lines.append(f"  queue      #{s.queue_position}, waiting {s.waited_s or 0:.1f} s")
    elif s.waited_s is not None:
        lines.append(f"  waited     {s.waited_s:.1f} s before admission")
    lines.append(f"  admitted   {s.attempts} time(s), preempted {s.preemptions} time(s); holds {s.nodes} node(s)")
    step = "-" if s.step is None else str(s.step)
    lines.append(f"  step       {step} of {s.steps}" + ("" if s.loss is None else f", loss {s.loss:.4f}"))
    if s.tokens_per_s is not None:
        plan = (
            f" (plan {s.plan_tokens_per_s:,.0f}: x{s.tokens_per_s / s.plan_tokens_per_s:.2f})"
            if s.plan_tokens_per_s
            else ""
        )
        lines.append(f"  tokens/s   {s.tokens_per_s:,.0f}{plan}")
    lines.append(f"  checkpoint {'-' if s.last_checkpoint is None else 'step ' + str(s.last_checkpoint)}")
    if s.run:
        parent = f", branched from {s.parent['run']} step {s.parent['step']}" if s.parent else ""
        lines.append(f"  run        {s.run}{parent}")
    if s.cost_usd is not None:
        lines.append(f"  cost       ${s.cost_usd:,.2f} so far")
    if s.exit_code is not None:
        lines.append(f"  exit code  {s.exit_code}")
    return lines


def run_describe(args) -> int:
    status = _backend(args).describe(args.name, team=args.team)
    if args.json:
        print(status.model_dump_json(indent=2))
    else:
        print("\n".join(describe_lines(status)))
    return 0


def run_logs(args) -> int:
    for line in _backend(args).logs(args.name, team=args.team, follow=args.follow):
        sys.stdout.write(line)
        sys.stdout.flush()
    return 0


def run_cancel(args) -> int:
    status = _backend(args).cancel(args.name, team=args.team)
    if args.json:
        print(status.model_dump_json(indent=2))
    else:
        print(f"job {status.name}: {status.state}. {status.message}".strip())
    return 0


def run_wait(args) -> int:
    if args.state != "done" and args.state not in ("queued", "running", *FINAL_STATES):
        raise BadInput(f"--state {args.state!r}: expected done, queued, running or one of {', '.join(FINAL_STATES)}")
    backend = _backend(args)
    deadline = time.monotonic() + args.timeout
    pending = list(args.names)
    while pending:
        for name in list(pending):
            s = backend.describe(name, team=args.team)
            done = s.state in FINAL_STATES if args.state == "done" else s.state == args.state
            if done and args.step is not None:
                done = s.step is not None and s.step >= args.step
            if done:
                print(f"job {name}: {s.state}" + ("" if s.step is None else f" at step {s.step}"), flush=True)
                pending.remove(name)
        if pending and time.monotonic() > deadline:
            print(f"timed out after {args.timeout:.0f} s waiting for {', '.join(pending)}", file=sys.stderr)
            return EXIT_FAILED
        if pending:
            time.sleep(0.5)
    return 0


def run_runner(args) -> int:
    from ...tools.jobs_local import LocalBackend

    return LocalBackend(args.home).run_runner(linger_s=args.linger)
