"""Stack outputs match the contract; `read_stack_outputs` round-trips through a StackReference
under the mocks and names what is missing or mismatched."""

from __future__ import annotations

import asyncio

import pulumi
import pytest
from aws_preview import Stack, preview
from pulumi.runtime import mocks as pmocks
from pulumi.runtime import settings as psettings

from supernode.components.aws.outputs import (
    StackOutputsError,
    export_stack_outputs,
    parse_stack_outputs,
    read_stack_outputs,
)
from supernode.core.contract import CONTRACT_VERSION, StackOutputs
from supernode.tools.preview import CloudMocks

REF = "acme/supernode/prod"


def test_outputs_match_the_contract(stack: Stack):
    assert set(stack.outputs) == set(StackOutputs.model_fields) | {"plan"}
    out = StackOutputs.model_validate({k: v for k, v in stack.outputs.items() if k != "plan"})
    assert out.contract_version == CONTRACT_VERSION
    assert out.node_group_names == [g.name for g in stack.cfg.accelerator_node_groups]
    assert out.vpc_id.startswith("vpc-") and out.efa_security_group_id.startswith("sg-")
    assert set(out.kms_key_arns) == {"eks", "data", "ops"}


def test_export_rejects_a_missing_key():
    values = dict.fromkeys(StackOutputs.model_fields, "x")
    del values["fsx_id"]
    with pytest.raises(StackOutputsError, match="fsx_id"):
        export_stack_outputs(values)


def _read_through_stack_reference(outputs: dict) -> StackOutputs:
    """Run a consumer's program under the mocks, with `outputs` as the referenced stack's."""
    psettings.reset_options()
    psettings.set_root_resource(None)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    got: list = []

    @pulumi.runtime.test
    def program():
        return read_stack_outputs(REF).apply(got.append)

    try:
        pmocks.set_mocks(
            CloudMocks("us-east-1", stack_outputs={REF: outputs}), project="consumer", stack="dev", preview=False
        )
        program()
    finally:
        loop.close()
        asyncio.set_event_loop(None)
    return got[0]


def test_read_stack_outputs_round_trips():
    exported = {k: v for k, v in preview("prod").outputs.items() if k != "plan"}
    read = _read_through_stack_reference({**exported, "plan": {"world_size": 128}})
    assert read.model_dump() == exported


def test_read_stack_outputs_names_a_missing_output():
    exported = {k: v for k, v in preview("prod").outputs.items() if k not in ("plan", "fsx_dns_name")}
    with pytest.raises(StackOutputsError, match=f"{REF}.*missing.*fsx_dns_name"):
        _read_through_stack_reference(exported)


def test_parse_names_mismatches():
    good = {k: v for k, v in preview("dev").outputs.items() if k != "plan"}
    with pytest.raises(StackOutputsError, match="contract 2.0"):
        parse_stack_outputs("s", {**good, "contract_version": "2.0"})
    with pytest.raises(StackOutputsError, match="node_group_names"):
        parse_stack_outputs("s", {**good, "node_group_names": "gpu-p5"})
    with pytest.raises(StackOutputsError, match="no contract_version"):
        parse_stack_outputs("s", {})
    assert (
        parse_stack_outputs("s", {**good, "contract_version": "1.7", "added_later": 1}).cluster_name
        == good["cluster_name"]
    )
