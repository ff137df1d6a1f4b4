"""What every command shares: the --stack / --config arguments and the consoles."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from ..core.config import StackConfig, load_file, load_stack


def plain_console(stderr: bool = False, **kwargs) -> Console:
    """Every console the CLI prints on: no emoji codes, so `:x:` in a message or a resource's name
    stays the text it is (rich would print it as an emoji)."""
    return Console(stderr=stderr, emoji=False, **kwargs)


err = plain_console(stderr=True, highlight=False, soft_wrap=True)


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
