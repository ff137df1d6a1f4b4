"""Stack outputs for other teams (issue 3, part 7): the exporter this stack uses and the reader
other teams' Pulumi programs call, both bound to the typed contract in `supernode.core.contract`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pulumi
from pydantic import ValidationError

from supernode.core.contract import CONTRACT_VERSION, StackOutputs

SECRET_OUTPUTS = frozenset({"kubeconfig"})


class StackOutputsError(Exception):
    """A referenced stack's outputs are missing, of another contract version, or malformed."""


def export_stack_outputs(values: Mapping[str, Any]) -> None:
    """Export exactly the contract's keys (a missing or unknown key is a bug here, not later)."""
    expected = set(StackOutputs.model_fields)
    missing, unknown = expected - set(values), set(values) - expected
    if missing or unknown:
        raise StackOutputsError(
            f"stack outputs do not match contract {CONTRACT_VERSION}: "
            f"missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    for key in StackOutputs.model_fields:
        value = values[key]
        pulumi.export(key, pulumi.Output.secret(value) if key in SECRET_OUTPUTS else value)


def parse_stack_outputs(stack_name: str, outputs: Mapping[str, Any]) -> StackOutputs:
    """Validate a stack's raw outputs against the contract, naming every problem."""
    version = outputs.get("contract_version")
    if version is None:
        raise StackOutputsError(
            f"stack {stack_name!r} exports no contract_version: is it a supernode stack, "
            f"and has it been deployed? (outputs present: {sorted(outputs) or 'none'})"
        )
    if str(version).split(".")[0] != CONTRACT_VERSION.split(".")[0]:
        raise StackOutputsError(
            f"stack {stack_name!r} exports contract {version}; this reader understands "
            f"{CONTRACT_VERSION.split('.')[0]}.x — upgrade the reader or pin the stack"
        )
    # Keys a newer minor version added are ignored; keys this version needs must all be there.
    known = {k: v for k, v in outputs.items() if k in StackOutputs.model_fields}
    missing = sorted(set(StackOutputs.model_fields) - set(known))
    if missing:
        raise StackOutputsError(f"stack {stack_name!r} is missing contract outputs: {', '.join(missing)}")
    try:
        return StackOutputs.model_validate(known)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']} (got {type(err['input']).__name__})"
            for err in e.errors(include_url=False)
        )
        raise StackOutputsError(f"stack {stack_name!r} has mismatched outputs: {problems}") from None


def read_stack_outputs(stack_name: str, opts: pulumi.ResourceOptions | None = None) -> pulumi.Output[StackOutputs]:
    """The contract outputs of a deployed supernode stack (`org/supernode/prod`), for other teams'
    programs: `read_stack_outputs("acme/supernode/prod").apply(lambda o: o.cluster_name)`."""
    ref = pulumi.StackReference(stack_name, opts=opts)
    return ref.outputs.apply(lambda outputs: parse_stack_outputs(stack_name, outputs or {}))
