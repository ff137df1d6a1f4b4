"""`supernode verify`: after `pulumi up`, check the deployed resources against the config and plan."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ...core.contract import StackOutputs
from ...core.errors import EXIT_FAILED, EXIT_OK, BadInput
from ...core.plan import build_plan
from ...tools.awscheck import failures, render, to_json
from ...tools.verify import OutputsError, load_outputs, parse_outputs, run_verify
from ..args import add_stack_args, plain_console, stack_from_args


def register(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="after pulumi up: EKS, node groups, FSx, bucket, alarms, logs, SNS (boto3; honours AWS_ENDPOINT_URL)",
    )
    add_stack_args(p)
    p.add_argument(
        "--outputs",
        type=Path,
        help="JSON of `pulumi stack output --json --show-secrets` "
        "(default: ask the pulumi CLI for the stack's outputs)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (sorted, stable)")
    p.set_defaults(func=run)


def outputs_from_pulumi(stack: str, root: Path) -> StackOutputs:
    if shutil.which("pulumi") is None:
        raise OutputsError(
            "the pulumi CLI is not on PATH: pass --outputs FILE "
            "(written by `pulumi stack output --json --show-secrets`)"
        )
    done = subprocess.run(
        ["pulumi", "stack", "output", "--json", "--show-secrets", "--stack", stack],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise OutputsError(f"`pulumi stack output --stack {stack}` failed: {done.stderr.strip()}")
    return parse_outputs(done.stdout, f"pulumi stack output --stack {stack}")


def run(args) -> int:
    stack, cfg = stack_from_args(args)
    try:
        outs = load_outputs(args.outputs) if args.outputs else outputs_from_pulumi(stack, args.root)
    except OutputsError as e:
        raise BadInput(str(e)) from None
    checks = run_verify(cfg, build_plan(stack, cfg), outs)
    if args.json:
        print(to_json("verify", stack, checks))
    else:
        render(f"supernode verify: {stack} ({cfg.region}, cluster {outs.cluster_name})", checks, plain_console())
    return EXIT_FAILED if failures(checks) else EXIT_OK
