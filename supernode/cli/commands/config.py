"""`supernode config reference`: the configuration reference (docs/configuration.md), from the schema."""

from __future__ import annotations

from ...core.config.reference import reference


def register(sub) -> None:
    p = sub.add_parser("config", help="the stack configuration schema")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    ref = verbs.add_parser("reference", help="print the configuration reference as Markdown (docs/configuration.md)")
    ref.set_defaults(func=run_reference)


def run_reference(args) -> int:
    print(reference())
    return 0
