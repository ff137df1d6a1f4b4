"""The pack's contents: served by `policies/__main__.py` (Pulumi CLI) and run in-process by
`supernode.tools.policycheck`."""

from __future__ import annotations

from . import accelerators, management, monitoring, readiness, security, serving, storage
from .base import ChecklistPolicy

PACK_NAME = "supernode-checklist"
# By checklist item group: 1-3, 4-5, 6-8, 9, 10, then serving's (items 2, 7, 9, 10).
POLICIES: list[ChecklistPolicy] = [
    *accelerators.POLICIES,
    *readiness.POLICIES,
    *storage.POLICIES,
    *monitoring.POLICIES,
    *security.POLICIES,
    *management.POLICIES,
    *serving.POLICIES,
]

CHECKLIST_ITEMS = {
    1: "Accelerators",
    2: "Memory fit",
    3: "Interconnect",
    4: "Consistent versions",
    5: "Code and config ready",
    6: "Data",
    7: "Weights verified",
    8: "Checkpoint storage",
    9: "Monitoring",
    10: "Access control and keys",
}

BY_NAME: dict[str, ChecklistPolicy] = {p.name: p for p in POLICIES}


def item_of(policy: str) -> int:
    return BY_NAME[policy].item
