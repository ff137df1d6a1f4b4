"""`supernode init [--root DIR] [--stack NAME] [--force]`: a Pulumi project for the installed package, so
`pulumi up` runs from a pip install (the wheel holds the program, not a project): `Pulumi.yaml` (runtime
python, in the virtual environment this command runs in), a `__main__.py` that calls the packaged
program (supernode.components.program), and a starter `Pulumi.<stack>.yaml`, the shipped dev stack
(supernode/cli/project/, a copy of the repository's Pulumi.dev.yaml). Existing files are not replaced
unless --force: nothing is written when one is in the way."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from ...core.errors import BadInput

TEMPLATE_STACK = Path(__file__).parents[1] / "project" / "Pulumi.dev.yaml"
# Pulumi's own rule for a stack name
STACK_NAME = re.compile(r"[A-Za-z0-9_.-]+")
MAIN = '''"""Entry point for the Pulumi CLI (written by `supernode init`): the program is the installed
supernode package's, so upgrading the package upgrades the program."""

from supernode.components.program import main

main()
'''


def register(sub) -> None:
    p = sub.add_parser(
        "init", help="write a Pulumi project (Pulumi.yaml, __main__.py, a starter stack) for this install"
    )
    p.add_argument("--root", type=Path, default=Path("."), help="project directory to write into (default: .)")
    p.add_argument("--stack", default="dev", help="the starter stack's name: Pulumi.STACK.yaml (default: dev)")
    p.add_argument("--force", action="store_true", help="overwrite those files where they exist")
    p.set_defaults(func=run)


def pulumi_yaml() -> str:
    """The project file: the repository's Pulumi.yaml, with the interpreter this package is installed
    in as the program's virtual environment (outside a venv: the python3 on PATH, said in the file)."""
    if sys.prefix != sys.base_prefix:
        venv = f"    virtualenv: {sys.prefix}\n"
    else:
        venv = "    # no virtualenv: Pulumi runs the python3 on PATH, which must have supernode installed\n"
    return (
        "# Written by `supernode init`: the program is the installed supernode package (__main__.py).\n"
        "name: supernode\n"
        "description: Mixture-of-Experts LLM training on EFA accelerator clusters (EKS, FSx for Lustre, S3)\n"
        "runtime:\n"
        "  name: python\n"
        "  options:\n"
        "    toolchain: pip\n"
        f"{venv}"
        "config:\n"
        "  pulumi:tags:\n"
        "    value:\n"
        "      pulumi:template: supernode\n"
    )


def run(args) -> int:
    if not STACK_NAME.fullmatch(args.stack):
        raise BadInput(f"--stack {args.stack!r}: a stack name is letters, digits, '_', '.' and '-'")
    root = args.root
    for parent in (root, *root.absolute().parents):
        if parent.exists() and not parent.is_dir():
            raise BadInput(f"--root {root}: {parent} is a file, not a directory")
    files = {
        root / "Pulumi.yaml": pulumi_yaml(),
        root / "__main__.py": MAIN,
        root / f"Pulumi.{args.stack}.yaml": TEMPLATE_STACK.read_text(encoding="utf-8"),
    }
    if not args.force:
        for path in files:
            if path.exists():
                raise BadInput(f"{path}: exists; pass --force to overwrite it, or give another --root")
    root.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    stack = args.stack
    print(
        f"next: set your region, network, access CIDRs and images in {root / f'Pulumi.{stack}.yaml'}; check it offline "
        f"with `supernode preview --stack {stack} --root {root}`; then in {root}: `pulumi stack init {stack}` "
        f"and `pulumi up --stack {stack}`"
    )
    return 0
