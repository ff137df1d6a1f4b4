"""What every command shares: the --stack / --config arguments and the stderr console."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from ..core.config import StackConfig, load_file, load_stack

err = Console(stderr=True, highlight=False, soft_wrap=True)


def add_stack_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--stack", help="stack name: reads Pulumi.STACK.yaml from --root")
    g.add_argument("--config", type=Path, help="a Pulumi stack file to read instead")
    p.add_argument("--root", type=Path, default=Path("."), help="project directory (default: .)")


def stack_from_args(args: argparse.Namespace) -> tuple[str, StackConfig]:
    if args.config is not None:
        name = args.config.name.removeprefix("Pulumi.").removesuffix(".yaml").removesuffix(".yml") or "stack"
        return name, load_file(args.config)
    return args.stack, load_stack(args.stack, args.root)
