"""`supernode policy check`: the CrossGuard pack on a recorded resources list, offline (no Pulumi CLI, no cloud)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ...core.errors import EXIT_FAILED, BadInput
from ...tools.policycheck import (
    PolicyInputError,
    PolicyReport,
    check,
    config_from_stack,
    junit_xml,
    load_policy_config,
    load_resources,
)
from ..args import add_stack_args, plain_console, stack_from_args

STYLE = {"pass": "green", "fail": "bold red", "warn": "yellow", "remediated": "cyan", "disabled": "dim"}


def register(sub) -> None:
    p = sub.add_parser("policy", help="the CrossGuard policy pack, offline")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = actions.add_parser("check", help="run the pack on a recorded resources list (supernode preview --json)")
    c.add_argument(
        "--resources",
        type=Path,
        required=True,
        help="a `supernode preview --json` output, or a bare list of resources in that format",
    )
    add_policy_args(c)
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(func=run_check)
    k = actions.add_parser(
        "config",
        help="the policy config a stack implies, for `pulumi preview "
        "--policy-pack policies --policy-pack-config FILE` and `policy check`",
    )
    add_stack_args(k)
    k.set_defaults(func=run_config)


def add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy-config",
        type=Path,
        help="policy config (the Pulumi CLI's --policy-pack-config format: policy -> level or settings)",
    )
    p.add_argument("--junit", type=Path, help="also write a JUnit XML report of the policy results")


def policy_config(path: Path | None, base: dict | None = None) -> dict:
    """`base` (what the stack implies) overlaid per policy by the user's file."""
    merged = {k: dict(v) for k, v in (base or {}).items()}
    try:
        user = load_policy_config(path) if path else {}
    except PolicyInputError as e:
        raise BadInput(str(e)) from None
    for name, value in user.items():
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name].update(value)
        else:
            merged[name] = value
    return merged


def run_pack(resources: list[dict], config: dict, junit: Path | None) -> PolicyReport:
    try:
        report = check(resources, config)
    except PolicyInputError as e:
        raise BadInput(str(e)) from None
    if junit:
        try:
            junit.parent.mkdir(parents=True, exist_ok=True)
            junit.write_text(junit_xml(report), encoding="utf-8")
        except OSError as e:
            raise BadInput(f"--junit {junit}: cannot write ({e})") from None
    return report


def render(report: PolicyReport, console: Console) -> None:
    t = Table(title="policy compliance (supernode-checklist)", header_style="bold")
    for col in ("item", "policy", "result", "enforcement", "resource"):
        t.add_column(col, justify="right" if col == "item" else "left", no_wrap=col != "resource")
    for row in report.rows():
        t.add_row(
            str(row["item"]),
            row["policy"],
            Text(row["result"], style=STYLE[row["result"]]),
            row["enforcement"],
            Text(row["resource"] or "-"),
        )
    console.print(t)
    for v in report.violations:
        colour = "red" if v.enforcement == "mandatory" else "yellow"
        detail = v.message.split("\n", 1)[-1]  # the SDK prefixes the policy description
        console.print(Text.assemble((v.enforcement, colour), " ", (v.policy, "bold"), ": ", detail))
    n = len(report.mandatory)
    console.print(
        "[green]all mandatory policies pass[/]"
        if not n
        else f"[bold red]{n} mandatory violation(s)[/]: fix them before deploying"
    )


def run_check(args) -> int:
    try:
        resources = load_resources(args.resources)
    except PolicyInputError as e:
        raise BadInput(str(e)) from None
    report = run_pack(resources, policy_config(args.policy_config), args.junit)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        render(report, plain_console())
    return 0 if report.passed else EXIT_FAILED


def run_config(args) -> int:
    _, cfg = stack_from_args(args)
    print(json.dumps(config_from_stack(cfg), indent=2))
    return 0
