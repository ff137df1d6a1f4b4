"""`supernode serve-env [--path DIR] [--dry-run]`: the serving environment `supernode serve` runs vLLM
from (its CPU build, in a venv of its own: supernode/tools/serve.py says why), installed from the pins
shipped with the package. By default per user ($XDG_DATA_HOME/supernode/serve-venv, else
~/.local/share/supernode/serve-venv), where `supernode serve` looks for it after $SUPERNODE_SERVE_PYTHON
and a checkout's .venv-serve; in a checkout `make serve-env` runs this with --path .venv-serve. Running
it again on the same venv completes or refreshes it."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from ...core.errors import EXIT_FAILED
from ...tools.serve import PYTHON_ENV, SERVE_VENV, serve_env_commands, user_serve_venv
from ..args import err


def register(sub) -> None:
    p = sub.add_parser("serve-env", help="create the vLLM (CPU) environment `supernode serve` runs")
    p.add_argument(
        "--path",
        type=Path,
        default=None,
        help=f"the venv to create or complete (default: {user_serve_venv()}, from $XDG_DATA_HOME or ~/.local/share)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.set_defaults(func=run)


def run(args) -> int:
    venv = (args.path or user_serve_venv()).absolute()
    commands = serve_env_commands(venv)  # bad --path: exit 2 before anything runs
    for cmd in commands:
        print(shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            err.print(
                f"serve-env failed: `{shlex.join(cmd)}` exited {rc}; fix the cause above and run it again "
                "(it completes the same venv)",
                markup=False,
            )
            return EXIT_FAILED
    if args.dry_run:
        return 0
    python = venv / "bin" / "python"
    print(f"serving environment ready: {python}")
    if venv != user_serve_venv().absolute():  # not where serve looks by default: say how it finds this one
        print(f"`supernode serve` uses it as {SERVE_VENV} in --root, or with {PYTHON_ENV}={python}")
    return 0
