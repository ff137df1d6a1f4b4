"""What every component shares about the stack it belongs to, built once by the program
(components/program.py) and passed once to each component (the first field of its Args;
NodeRole, which has no Args, takes it as a parameter) instead of stack, region, account and tags
repeated in every Args class."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pulumi


@dataclass(frozen=True)
class StackContext:
    stack: str  # the Pulumi stack name: in AWS names (KMS aliases, log groups, alarms) and descriptions
    region: str
    account_id: pulumi.Input[str]
    # On every taggable AWS resource, explicitly rather than through the provider's default_tags:
    # the policies (and `supernode policy check` on a saved preview) read tags from resource inputs.
    tags: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, stack: str, region: str, account_id: pulumi.Input[str]) -> StackContext:
        return cls(
            stack=stack,
            region=region,
            account_id=account_id,
            tags={"Project": "supernode", "Stack": stack, "ManagedBy": "pulumi"},
        )

    def tagged(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A fresh tag dict for one resource: the stack's tags plus `extra` (Name, discovery tags)."""
        return {**self.tags, **(extra or {})}
