"""`supernode` command line. Each subcommand lives in `supernode/cli/commands/<name>.py` and exposes
`register(subparsers)`; this module discovers them, and gives every command's --help its examples
(EXAMPLES) and the exit codes.

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

from .. import __version__
from ..core.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, bad_input_lines
from . import commands
from .args import err

DESCRIPTION = (
    "Mixture-of-Experts training on GPU supernode clusters, declared as code: plan the parallel layout, "
    "preview the Pulumi stack offline with its policy pack, check AWS before and after `pulumi up`, "
    "and train the plan locally."
)
EXIT_CODES = "exit codes: 0 ok; 1 a check, policy or run failed; 2 bad input (every problem printed, no traceback)"
# One or two commands a user would type, per command (leaf commands by their full name).
EXAMPLES = {
    "bench": [
        "supernode bench preview",
        "supernode bench moe --help",
        "supernode bench serve --model out/demo/model --concurrency 1,4,16",
    ],
    "checkpoints": [
        "supernode checkpoints --stack prod --outputs out.json --fsx /fsx/checkpoints",
        "supernode checkpoints --stack prod --bucket my-bucket --retain --dry-run",
    ],
    "config reference": ["supernode config reference > docs/configuration.md"],
    "drill restore": [
        "supernode drill restore --stack prod --outputs out.json",
        "supernode drill restore --stack dev --local --outputs out.json --json",
    ],
    "data prepare": [
        "supernode data prepare --corpus notes.txt --out data/",
        "supernode data prepare --corpus docs.jsonl --train-bpe 4096 --out data/bpe",
    ],
    "data push": ["supernode data push --stack dev data/bpe --outputs out.json"],
    "data verify": ["supernode data verify data/bpe"],
    "model push": [
        "supernode model push --stack dev out/demo/model --outputs out.json",
        "supernode model push --stack prod out/model",
    ],
    "init": ["supernode init --root my-cluster", "supernode init --root my-cluster --stack prod"],
    "import": [
        "supernode import --stack dev --local --from out/demo/model",
        "supernode import --stack dev --local --from ~/models/qwen3-moe-tiny --write-manifest",
    ],
    "job plan": [
        "supernode job plan --stack prod jobs/moe-lr-sweep.yaml",
        "supernode job plan --stack dev job.yaml --json",
    ],
    "job submit": [
        "supernode job submit --stack prod jobs/moe-lr-sweep.yaml",
        "supernode job submit --stack dev --local jobs/demo-low.yaml",
        "supernode job submit --stack prod jobs/moe-lr-sweep.yaml --dry-run out/manifests",
    ],
    "job list": ["supernode job list --stack prod --team research", "supernode job list --local --json"],
    "job describe": ["supernode job describe --stack prod moe-lr-sweep", "supernode job describe --local demo-low"],
    "job logs": ["supernode job logs --stack prod moe-lr-sweep --follow", "supernode job logs --local demo-low"],
    "job cancel": ["supernode job cancel --stack prod moe-lr-sweep", "supernode job cancel --local demo-low"],
    "job wait": ["supernode job wait --local demo-low --state running --step 20", "supernode job wait --local a b"],
    "job runner": ["supernode job runner --home out/jobs (started by `job submit --local`)"],
    "plan": ["supernode plan --stack prod", "supernode plan --config Pulumi.p4d.yaml --json"],
    "policy check": [
        "supernode preview --stack prod --json > preview.json",
        "supernode policy check --resources preview.json --junit report.xml",
    ],
    "policy config": [
        "supernode policy config --stack prod > pc.json",
        "pulumi preview --policy-pack policies --policy-pack-config pc.json",
    ],
    "preflight": ["supernode preflight --stack prod", "AWS_PROFILE=ml supernode preflight --stack prod --json"],
    "preview": ["supernode preview --stack dev", "supernode preview --stack prod --tree --manifests out/manifests"],
    "export": ["supernode export --stack dev --local --checkpoint out/demo --data out/demo/data --out out/demo/model"],
    "serve": [
        "supernode serve --stack dev --local --model out/demo/model --prompt 'def '",
        "supernode serve --stack dev --local --model out/demo/model --port 8000",
    ],
    "serve-env": ["supernode serve-env", "supernode serve-env --path ~/venvs/vllm --dry-run"],
    "train": [
        "supernode train --stack dev --local --steps 40",
        "supernode train --stack dev --local --steps 80 --run new --from-run RUN --step 40",
    ],
    "ui": ["supernode ui --local", "supernode ui --local --home out/jobs --port 0 --stack dev"],
    "verify": [
        "pulumi stack output --json --show-secrets > out.json",
        "supernode verify --stack prod --outputs out.json",
    ],
}


def _leaves(parser: argparse.ArgumentParser, name: str = "", help: str = ""):
    """(full name, parser, its one-line help) of every command that takes no further subcommand."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield name, parser, help
    for action in subs:
        helps = {a.dest: a.help for a in action._choices_actions}
        for child, sub in action.choices.items():
            yield from _leaves(sub, f"{name} {child}".strip(), helps.get(child, ""))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="supernode", description=DESCRIPTION, epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"supernode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{mod.name}").register(sub)
    for name, leaf, help in _leaves(parser):
        leaf.formatter_class = argparse.RawDescriptionHelpFormatter
        leaf.description = leaf.description or help
        examples = "\n".join(f"  {e}" for e in EXAMPLES.get(name, []))
        leaf.epilog = f"examples:\n{examples}\n\n{EXIT_CODES}" if examples else EXIT_CODES
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
