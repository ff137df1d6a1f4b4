"""Fault injection for the failure tests: `SUPERNODE_INJECT_FAULT=name@arg[,...]` (e.g. "enospc@4",
"nan@3", "stall@5"), read where the fault is staged."""

from __future__ import annotations

import os

INJECT_ENV = "SUPERNODE_INJECT_FAULT"


def inject(fault: str) -> str | None:
    """The argument of `fault@ARG` in SUPERNODE_INJECT_FAULT, if the test asked for that fault."""
    for item in os.environ.get(INJECT_ENV, "").split(","):
        name, _, arg = item.partition("@")
        if name == fault:
            return arg
    return None
