"""Entry point for the Pulumi CLI (`pulumi preview --policy-pack policies`): serves the pack over gRPC forever."""

import importlib.util
import sys
from pathlib import Path

# The pack imports the supernode core from this checkout (see requirements.txt for why it is not installed):
# the repository root on sys.path gives `supernode.core`, and this directory is `supernode.policies`, as the
# wheel installs it (pyproject.toml's package-dir).
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
_spec = importlib.util.spec_from_file_location(
    "supernode.policies", HERE / "__init__.py", submodule_search_locations=[str(HERE)]
)
sys.modules["supernode.policies"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sys.modules["supernode.policies"])

from pulumi_policy import EnforcementLevel, PolicyPack  # noqa: E402

from supernode.policies.pack import PACK_NAME, POLICIES  # noqa: E402

PolicyPack(name=PACK_NAME, policies=POLICIES, enforcement_level=EnforcementLevel.MANDATORY)
