"""`supernode ui --local | --cluster`: the management page (issue 37).

The page itself (routes, templates, CSRF, the viewer's teams) is supernode.tools.ui; this command only
builds its context and starts the server. --local: over this machine's job queue
(supernode.tools.jobs_local, the queue `supernode job --local` uses), on 127.0.0.1. --cluster: what the
stack's Deployment runs (components/k8s/management_ui.py) behind its load balancer: the cluster backend
as the pod's service account, every request authenticated by the load balancer's signed identity header
(--signer: that load balancer's ARN; supernode.tools.ui_auth), each submit and cancel in the audit log
group (--audit-log-group).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ...core.errors import BadInput
from ..args import add_stack_args, stack_from_args
from .job import DEFAULT_HOME, stack_args

DEFAULT_PORT = 8080


def register(sub) -> None:
    p = sub.add_parser("ui", help="the management page: jobs, a job's plan, loss and log, submit and cancel")
    add_stack_args(p, required=False)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="over this machine's job queue (--home), on 127.0.0.1")
    mode.add_argument(
        "--cluster",
        action="store_true",
        help="in the cluster, behind the stack's load balancer (the stack's Deployment runs this)",
    )
    p.add_argument("--signer", help="--cluster: the ARN of the load balancer whose identity header is trusted")
    p.add_argument("--audit-log-group", help="--cluster: the CloudWatch log group of the audit records")
    p.add_argument("--home", type=Path, default=DEFAULT_HOME, help=f"the local queue (default: {DEFAULT_HOME})")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port on 127.0.0.1 (default: {DEFAULT_PORT}; 0: a free one)"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    if not (args.local or args.cluster):
        raise BadInput(
            "give --local (this machine's job queue) or --cluster (the stack's deployment behind its load "
            "balancer: components/k8s/management_ui.py)"
        )
    if not 0 <= args.port <= 65535:
        raise BadInput(f"--port {args.port}: expected 0 (a free port) to 65535")
    if args.cluster:
        return run_cluster(args)
    if args.stack is None and args.config is None:
        args.stack = "dev"  # what a submit from the page is planned against: the demo's stack
    stack, cfg = stack_from_args(args)

    from ...tools.ui import local_context, serve

    ctx = local_context(args.home, stack, cfg, stack_args(args))

    def ready(url: str) -> None:
        print(f"supernode ui: the local jobs of {args.home} (stack {stack}) at {url}", flush=True)

    try:
        serve(ctx, port=args.port, ready=ready)
    except KeyboardInterrupt:
        pass
    sys.stdout.flush()
    return 0


def run_cluster(args) -> int:
    """The page in the cluster: the stack's config (--stack or --config, the Deployment mounts it)."""
    if not args.signer or not args.audit_log_group:
        raise BadInput("--cluster needs --signer (the load balancer's ARN) and --audit-log-group")
    stack, cfg = stack_from_args(args)
    ui = cfg.management.ui
    if ui is None:
        raise BadInput(f"stack {stack} has no management.ui: the page in the cluster needs its host name and OIDC")
    import os
    import socket

    from ...tools.ui import cluster_context, serve
    from ...tools.ui_auth import AlbIdentity, AuditLog

    teams = [t.name for t in cfg.teams]
    identity = AlbIdentity(cfg.region, args.signer, ui.oidc.groups_claim, teams)
    audit = AuditLog(args.audit_log_group, stream=os.environ.get("HOSTNAME") or socket.gethostname())
    ctx = cluster_context(stack, cfg, identity, audit)

    def ready(url: str) -> None:
        print(f"supernode ui: stack {stack}'s jobs at {url} (https://{ui.host_name}/ through its load balancer)")

    serve(ctx, port=args.port, ready=ready, host="0.0.0.0", allowed_hosts=[ui.host_name])  # noqa: S104
    return 0
