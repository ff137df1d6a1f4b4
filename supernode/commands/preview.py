"""`supernode preview`: the stack's resources under Pulumi's mock engine, offline."""

from __future__ import annotations

import json
from collections import Counter

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from ..cli import add_stack_args, stack_from_args
from ..plan import build_plan
from ..preview import PreviewResult, run_program
from .plan import render as render_plan


def register(sub) -> None:
    p = sub.add_parser("preview", help="offline preview: run the Pulumi program under the mock engine")
    add_stack_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (ARCHITECTURE.md §6)")
    p.set_defaults(func=run)


def preview_json(result: PreviewResult, plan_summary: dict, violations: list[dict]) -> dict:
    return {"stack": result.stack, "plan": plan_summary,
            "resources": [r.to_json() for r in result.resources],
            "outputs": result.outputs,
            "policy": {"violations": violations}}


def render_tree(result: PreviewResult, console: Console) -> None:
    stack_urn = f"urn:pulumi:{result.stack}::supernode::pulumi:pulumi:Stack::supernode-{result.stack}"
    root = Tree(f"[bold]pulumi:pulumi:Stack[/] supernode-{result.stack}")
    nodes = {stack_urn: root, "": root}
    for r in result.resources:  # parents register before their children
        parent = nodes.get(r.parent, root)
        nodes[r.urn] = parent.add(f"[cyan]{r.type}[/] {r.name}")
    console.print(root)
    counts = Counter(r.type for r in result.resources)
    table = Table(title=f"{len(result.resources)} resources", header_style="bold")
    table.add_column("type")
    table.add_column("count", justify="right")
    for typ, n in sorted(counts.items()):
        table.add_row(typ, str(n))
    console.print(table)


def run(args) -> int:
    stack, cfg = stack_from_args(args)
    plan = build_plan(stack, cfg)
    result = run_program(stack, cfg)
    violations: list[dict] = []
    if args.json:
        print(json.dumps(preview_json(result, plan.summary(), violations), indent=2))
    else:
        console = Console()
        render_tree(result, console)
        render_plan(plan, console)
    return 0
