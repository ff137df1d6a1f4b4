"""Bring your own VPC: dev deployed into an existing VPC creates no network of its own, places the
cluster, GPU nodes and FSx in the configured subnets, and still passes the policy pack."""

from __future__ import annotations

import pytest
from aws_preview import GPU_GROUP, NODE_GROUP, Stack, as_list, preview

from supernode.core import resource_types as T
from supernode.tools.policycheck import check, config_from_stack

VPC_ID = "vpc-0a1b2c3d4e5f60718"
PRIVATE_IDS = ["subnet-0a1b2c3d4e5f60711", "subnet-0a1b2c3d4e5f60722"]
GPU_ID = "subnet-0a1b2c3d4e5f60733"
# What the VPC owner provides and the stack must not create.
OWNERS = (
    T.VPC,
    T.SUBNET,
    T.ROUTE_TABLE,
    T.ROUTE_TABLE_ASSOCIATION,
    T.ROUTE,
    T.NAT_GATEWAY,
    T.INTERNET_GATEWAY,
    T.EIP,
    T.VPC_ENDPOINT,
)


def into_existing_vpc(data: dict) -> None:
    data["network"].update(
        existingVpcId=VPC_ID,
        existingPrivateSubnetIds=PRIVATE_IDS,
        existingGpuSubnetId=GPU_ID,
        natGateway=False,
        privateSubnetCidrs=[],
        publicSubnetCidrs=[],
        gpuSubnetCidr=None,
    )


@pytest.fixture(scope="module")
def byo() -> Stack:
    return preview("dev", "byo-vpc", into_existing_vpc)


def test_creates_no_vpc_subnets_routes_nat_or_endpoints(byo: Stack):
    assert {typ: [r.name for r in byo.all(typ)] for typ in OWNERS} == {typ: [] for typ in OWNERS}
    assert preview("dev").all(T.VPC)  # the same program does create them without existingVpcId


def test_outputs_are_the_configured_ids(byo: Stack):
    assert (byo.outputs["vpc_id"], byo.outputs["private_subnet_ids"], byo.outputs["gpu_subnet_id"]) == (
        VPC_ID,
        PRIVATE_IDS,
        GPU_ID,
    )


def test_cluster_nodes_and_fsx_are_placed_in_the_configured_subnets(byo: Stack):
    assert byo.one(T.EKS_CLUSTER).inputs["vpcConfig"]["subnetIds"] == PRIVATE_IDS
    gpu_groups = byo.all(GPU_GROUP)
    assert len(gpu_groups) == len(byo.cfg.accelerator_node_groups)
    for group in gpu_groups:
        (node_group,) = byo.children(group, NODE_GROUP)
        assert node_group.inputs["subnetIds"] == [GPU_ID]
    system = [r for r in byo.all(NODE_GROUP) if not any(r.parent == g.urn for g in gpu_groups)]
    assert system and all(r.inputs["subnetIds"] == PRIVATE_IDS for r in system)
    fsx = byo.one(T.FSX_LUSTRE).inputs
    assert as_list(fsx["subnetIds"]) == [GPU_ID]


def test_security_groups_and_flow_logs_are_on_the_existing_vpc(byo: Stack):
    groups = byo.all(T.SECURITY_GROUP)
    assert groups and {g.inputs["vpcId"] for g in groups} == {VPC_ID}
    assert byo.one(T.FLOW_LOG).inputs["vpcId"] == VPC_ID


def test_policies_pass(byo: Stack):
    report = check([r.to_json() for r in byo.result.resources], config_from_stack(byo.cfg))
    assert report.mandatory == [], "\n".join(f"{v.policy}: {v.message}" for v in report.mandatory)
    assert not [v for v in report.violations if "can't run policy" in v.message]
