"""`supernode preflight`: before `pulumi up`, check the AWS account against the stack's config."""

from __future__ import annotations

from ...core.errors import EXIT_FAILED, EXIT_OK
from ...tools.awscheck import failures, render, to_json, warnings
from ...tools.preflight import run_preflight
from ..args import add_stack_args, plain_console, stack_from_args


def register(sub) -> None:
    p = sub.add_parser(
        "preflight",
        help="before pulumi up: instance offerings, catalog, reservations, quota, "
        "existing VPC/subnets/bucket/KMS key (boto3; honours AWS_ENDPOINT_URL)",
    )
    add_stack_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (sorted, stable)")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 on a warning too: a check that could not be made (an API the endpoint lacks, access "
        "denied to a quota, a type EC2 does not describe) fails instead of passing unchecked; for CI",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    stack, cfg = stack_from_args(args)
    checks = run_preflight(cfg)
    unchecked = warnings(checks) if args.strict else 0
    if args.json:
        print(to_json("preflight", stack, checks, strict=args.strict))
    else:
        console = plain_console()
        render(f"supernode preflight: {stack} ({cfg.region}, {cfg.availability_zone})", checks, console)
        if unchecked:
            console.print(f"--strict: {unchecked} warning(s) fail preflight (each could not be checked)")
    return EXIT_FAILED if failures(checks) or unchecked else EXIT_OK
