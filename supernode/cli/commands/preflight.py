"""`supernode preflight`: before `pulumi up`, check the AWS account against the stack's config."""

from __future__ import annotations

from ...core.errors import EXIT_FAILED, EXIT_OK
from ...tools.awscheck import failures, render, to_json
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
    p.set_defaults(func=run)


def run(args) -> int:
    stack, cfg = stack_from_args(args)
    checks = run_preflight(cfg)
    if args.json:
        print(to_json("preflight", stack, checks))
    else:
        render(f"supernode preflight: {stack} ({cfg.region}, {cfg.availability_zone})", checks, plain_console())
    return EXIT_FAILED if failures(checks) else EXIT_OK
