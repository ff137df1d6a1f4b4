"""`supernode` command line. Each subcommand lives in `supernode/commands/<name>.py` and exposes
`register(subparsers)`; this module discovers them, so adding a command touches no shared file.

Exit codes (ARCHITECTURE.md §6): 0 ok; 1 a check or policy failed; 2 bad input. Bad input prints
every problem with its path and value to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from pathlib import Path

from rich.console import Console

from . import commands
from .config import ConfigError, StackConfig, load_file, load_stack

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
err = Console(stderr=True, highlight=False, soft_wrap=True)


class BadInput(Exception):
    """A flag, file or value the user gave is unusable: printed, exit 2."""


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


def print_config_error(e: ConfigError) -> None:
    err.print(f"[bold red]invalid configuration[/] {e.source}: {len(e.issues)} problem(s)", markup=True)
    for issue in e.issues:
        err.print(f"  {issue}", markup=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="supernode", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{mod.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse prints usage and exits 2 on bad flags
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print_config_error(e)
        return EXIT_BAD_INPUT
    except BadInput as e:
        err.print(f"error: {e}", markup=False)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a bug must still not dump a traceback on users
        if os.environ.get("SUPERNODE_DEBUG"):
            raise
        err.print(f"internal error: {type(e).__name__}: {e} (set SUPERNODE_DEBUG=1 for the traceback)", markup=False)
        return EXIT_FAILED


def entry() -> None:
    sys.exit(main())
