"""`supernode preview`: the stack's resources under Pulumi's mock engine, offline."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from ...core.errors import EXIT_FAILED
from ...tools.manifests import export as export_manifests
from ...tools.policycheck import config_from_stack
from ...tools.preview import PreviewResult, run_program
from ..args import add_stack_args, err, plain_console, stack_from_args
from .data import add_data_arg, check_plan_data
from .plan import render as render_plan
from .policy import add_policy_args, policy_config, run_pack
from .policy import render as render_policy

LOG_WIDTH = 240  # columns for output that is not a terminal: the longest type and resource names fit


def register(sub) -> None:
    p = sub.add_parser("preview", help="offline preview: run the Pulumi program under the mock engine")
    add_stack_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (docs/architecture.md §7)")
    p.add_argument(
        "--tree", action="store_true", help="print every resource in its component tree (default: counts per type)"
    )
    p.add_argument(
        "--manifests",
        type=Path,
        metavar="DIR",
        help="write every Kubernetes object as YAML to DIR and validate it (exit 1 if invalid)",
    )
    add_data_arg(p)
    add_policy_args(p)  # the policy pack runs on every preview; exit 1 on a mandatory violation
    p.set_defaults(func=run)


def preview_json(result: PreviewResult, plan_summary: dict, violations: list[dict]) -> dict:
    return {
        "stack": result.stack,
        "plan": plan_summary,
        "resources": [r.to_json() for r in result.resources],
        # as `pulumi stack output --json` prints them: secrets masked
        "outputs": {k: "[secret]" if k in result.secret_outputs else v for k, v in result.outputs.items()},
        "policy": {"violations": violations},
    }


def render_tree(result: PreviewResult, console: Console) -> None:
    stack_urn = f"urn:pulumi:{result.stack}::supernode::pulumi:pulumi:Stack::supernode-{result.stack}"
    root = Tree(f"[bold]pulumi:pulumi:Stack[/] supernode-{result.stack}")
    nodes = {stack_urn: root, "": root}
    for r in result.resources:  # parents register before their children
        parent = nodes.get(r.parent, root)
        nodes[r.urn] = parent.add(f"[cyan]{r.type}[/] {r.name}")
    console.print(root)


def render_counts(result: PreviewResult, console: Console) -> None:
    counts = Counter(r.type for r in result.resources)
    table = Table(title=f"{len(result.resources)} resources", header_style="bold")
    table.add_column("type")
    table.add_column("count", justify="right")
    for typ, n in sorted(counts.items()):
        table.add_row(typ, str(n))
    console.print(table)


def run(args) -> int:
    stack, cfg = stack_from_args(args)
    result = run_program(stack, cfg)
    plan = result.plan()  # the plan the program deployed, not a second one built here
    check_plan_data(plan, args.data)
    manifests = (
        export_manifests(result.resources, args.manifests, cfg.cluster.kubernetes_version) if args.manifests else None
    )
    report = run_pack(
        [r.to_json() for r in result.resources], policy_config(args.policy_config, config_from_stack(cfg)), args.junit
    )
    violations = [v.to_json() for v in report.violations]
    if args.json:
        print(json.dumps(preview_json(result, plan.summary(), violations), indent=2))
        for line in manifests.lines() if manifests else []:  # stdout holds only the JSON
            err.print(line, markup=False)
    else:
        console = plain_console()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            # A CI log, not a terminal: rich would assume 80 columns and cut resource types and names
            # short ("BucketServerSideEncr…"); a log has no width to fit, so give the tables room.
            console = plain_console(width=LOG_WIDTH)
        if args.tree:
            render_tree(result, console)
        render_counts(result, console)
        render_plan(plan, console)
        render_policy(report, console)
        for line in manifests.lines() if manifests else []:
            console.print(line, markup=False, style=None if manifests.ok else "red")
    return 0 if report.passed and (manifests is None or manifests.ok) else EXIT_FAILED
