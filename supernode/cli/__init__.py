"""`supernode` command line. Each subcommand lives in `supernode/cli/commands/<name>.py` and exposes
`register(subparsers)`; this module discovers them, so adding a command touches no shared file.

Exit codes and the bad-input messages come from `supernode.core.errors` (the trainer uses the same
mapping): 0 ok; 1 a check or policy failed; 2 bad input, every problem printed with its path and
value to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from ..core.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_BAD_INPUT, bad_input_lines
from . import commands
from .args import err


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
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a bug must still not dump a traceback on users
        lines = bad_input_lines(e)
        if lines is not None:
            for line in lines:
                err.print(line, markup=False)
            return EXIT_BAD_INPUT
        if os.environ.get("SUPERNODE_DEBUG"):
            raise
        err.print(f"internal error: {type(e).__name__}: {e} (set SUPERNODE_DEBUG=1 for the traceback)", markup=False)
        return EXIT_FAILED


def entry() -> None:
    sys.exit(main())
