"""`supernode verify`: after `pulumi up`, check the deployed resources against the config and plan."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

from ...core.config import StackConfig
from ...core.contract import StackOutputs
from ...core.errors import EXIT_FAILED, EXIT_OK, BadInput
from ...core.plan import build_plan
from ...tools.awscheck import failures, render, to_json
from ...tools.verify import OutputsError, ServingProbe, load_outputs, parse_outputs, run_verify
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
    s = p.add_argument_group(
        "serving",
        "with --serving-url: one completion through the serving service, its answer and its TTFT/ITL "
        f"against inference.ttftTargetMs/itlTargetMs; the API key is read from ${API_KEY_ENV} "
        "(the serving_api_key output), never from the command line",
    )
    s.add_argument("--serving-url", help="the service's base URL, e.g. https://prod-vllm.serving.svc:8000")
    s.add_argument("--serving-ca", type=Path, help="PEM file of the serving_ca output (TLS verification)")
    s.add_argument("--serving-prompt", default=ServingProbe.prompt, help="the prompt (default: %(default)r)")
    s.add_argument("--serving-expect", help="text the answer must contain (default: any non-empty answer)")
    p.set_defaults(func=run)


API_KEY_ENV = "SUPERNODE_SERVING_API_KEY"


def serving_probe(args, stack: str, cfg: StackConfig) -> ServingProbe | None:
    """The request --serving-url asks for; BadInput names the flag whose value is unusable."""
    if args.serving_url is None:
        return None
    if cfg.inference is None:
        raise BadInput(f"--serving-url: stack {stack} has no supernode:inference section, so nothing serves")
    u = urlsplit(args.serving_url)
    if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
        raise BadInput(f"--serving-url: expected http(s)://HOST:PORT, got {args.serving_url!r}")
    ca_pem = None
    if args.serving_ca is not None:
        try:
            ca_pem = args.serving_ca.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BadInput(f"--serving-ca: cannot read {args.serving_ca} ({e})") from None
    from ...components.k8s.serving import serving_app  # pulumi's modules, only when serving is asked for

    return ServingProbe(
        url=f"{u.scheme}://{u.netloc}",
        model=serving_app(stack),
        prompt=args.serving_prompt,
        expect=args.serving_expect,
        api_key=os.environ.get(API_KEY_ENV) or None,
        ca_pem=ca_pem,
    )


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
    serving = serving_probe(args, stack, cfg)
    try:
        outs = load_outputs(args.outputs) if args.outputs else outputs_from_pulumi(stack, args.root)
    except OutputsError as e:
        raise BadInput(str(e)) from None
    checks = run_verify(cfg, build_plan(stack, cfg), outs, serving=serving)
    if args.json:
        print(to_json("verify", stack, checks))
    else:
        render(f"supernode verify: {stack} ({cfg.region}, cluster {outs.cluster_name})", checks, plain_console())
    return EXIT_FAILED if failures(checks) else EXIT_OK
