"""Entry point for the Pulumi CLI (`pulumi preview --policy-pack policies`): serves the pack over gRPC forever."""

import sys
from pathlib import Path

# The pack imports the supernode core from this checkout (see requirements.txt for why it is not installed):
# with the repository root on sys.path, supernode/policies (a link to this directory) is supernode.policies.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pulumi_policy import EnforcementLevel, PolicyPack  # noqa: E402

from supernode.policies.pack import PACK_NAME, POLICIES  # noqa: E402

PolicyPack(name=PACK_NAME, policies=POLICIES, enforcement_level=EnforcementLevel.MANDATORY)
