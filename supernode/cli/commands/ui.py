"""`supernode ui --local`: the management page (issue 37) over this machine's job queue, on 127.0.0.1.

The page itself (routes, templates, CSRF, the viewer's teams) is supernode.tools.ui; this command only
builds its context over the local backend (supernode.tools.jobs_local, the queue `supernode job
--local` uses) and starts the server. The cluster's page is deployed by the stack (issue 37, item 2:
not built yet), so without --local there is nothing to serve.
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
    p.add_argument("--local", action="store_true", help="over this machine's job queue (--home), on 127.0.0.1")
    p.add_argument("--home", type=Path, default=DEFAULT_HOME, help=f"the local queue (default: {DEFAULT_HOME})")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port on 127.0.0.1 (default: {DEFAULT_PORT}; 0: a free one)"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.local:
        raise BadInput(
            "the cluster's management page is deployed by the stack (not built yet): give --local for "
            "this machine's job queue"
        )
    if not 0 <= args.port <= 65535:
        raise BadInput(f"--port {args.port}: expected 0 (a free port) to 65535")
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
