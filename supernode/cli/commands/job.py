"""`supernode job`: training jobs of a stack (issue 36). `job plan` builds a job's plan against the
stack's hardware with the stack's planner and says whether it may be submitted, without submitting."""

from __future__ import annotations

import json
from pathlib import Path

from ...core.errors import EXIT_FAILED
from ...core.jobs import job_plan, read_job, refusals
from ..args import add_stack_args, plain_console, stack_from_args
from .plan import plan_json, render


def register(sub) -> None:
    job = sub.add_parser("job", help="training jobs of the stack: plan one from a job file")
    jobs = job.add_subparsers(dest="job_command", required=True, metavar="COMMAND")
    p = jobs.add_parser(
        "plan",
        help="a job file's plan on the stack's hardware and every figure that would refuse it (exit 1); "
        "nothing is submitted",
    )
    add_stack_args(p)
    p.add_argument("job_file", type=Path, metavar="JOB_FILE", help="the job file (YAML: name, team, priority, ...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_plan)


def run_plan(args) -> int:
    stack, cfg = stack_from_args(args)
    job = read_job(args.job_file)
    plan = job_plan(stack, cfg, job, root=args.root)
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
        for line in refused:
            console.print(f"[red]refused: {line}[/]")
        if not refused:
            console.print("[green]the job fits its hardware and its grace period: it may be submitted[/]")
    return EXIT_FAILED if refused else 0
