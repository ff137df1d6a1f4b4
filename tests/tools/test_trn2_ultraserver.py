"""A Trn2 UltraServer group is the four trn2u.48xlarge of one UltraServer (issue 27).

Preflight: the group's reservation is a Capacity Block of that UltraServer type with a working NeuronLink
interconnect (DescribeCapacityReservationTopology, DescribeCapacityBlocks, DescribeCapacityBlockStatus).
Verify: the running instances share one UltraServer domain (DescribeInstanceTopology's CapacityBlockId), and
a group split over two UltraServers is one failure line naming each UltraServer's nodes.

moto 5.2.5 implements none of these four EC2 APIs, so their answers are recorded here in EC2's documented
response format (element names from botocore's EC2 model, which parses them as it parses AWS's); the
instances, their tags and private DNS names come from moto itself.
"""

from __future__ import annotations

from pathlib import Path

import boto3

from supernode.core.config import load_stack
from supernode.tools.awscheck import Aws, run_checks
from supernode.tools.preflight import check_ultraserver_block, preflight_steps
from supernode.tools.verify import check_ultraserver, ultraserver_problems

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-2"
RESERVATION = "cr-0a64a64a64a64a640"  # Pulumi.trn2.yaml's
BLOCK, OTHER_BLOCK = "cb-0123456789abcdef0", "cb-0fedcba9876543210"
XMLNS = 'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"'


def ec2_answer(stub, action: str, sets: str) -> None:
    stub.answer(
        action,
        stub.Answer(200, f"<{action}Response {XMLNS}><requestId>stub</requestId>{sets}</{action}Response>"),
    )


def group():
    return load_stack("trn2", ROOT).accelerator_node_groups[0]


# -- preflight: the reservation is the UltraServer's Capacity Block ---------------------------------------


def record_block(stub, block: str | None, ultraserver_type: str = "u-trn2x64", interconnect: str = "ok") -> None:
    topology = f"<capacityBlockId>{block}</capacityBlockId>" if block else ""
    ec2_answer(
        stub,
        "DescribeCapacityReservationTopology",
        f"<capacityReservationSet><item><capacityReservationId>{RESERVATION}</capacityReservationId>{topology}"
        f"<instanceType>trn2u.48xlarge</instanceType><state>active</state>"
        f"<availabilityZone>us-east-2b</availabilityZone></item></capacityReservationSet>",
    )
    ec2_answer(
        stub,
        "DescribeCapacityBlocks",
        f"<capacityBlockSet><item><capacityBlockId>{block}</capacityBlockId>"
        f"<ultraserverType>{ultraserver_type}</ultraserverType><availabilityZone>us-east-2b</availabilityZone>"
        f"<capacityReservationIdSet><item>{RESERVATION}</item></capacityReservationIdSet><state>active</state>"
        f"</item></capacityBlockSet>",
    )
    ec2_answer(
        stub,
        "DescribeCapacityBlockStatus",
        f"<capacityBlockStatusSet><item><capacityBlockId>{block}</capacityBlockId>"
        f"<interconnectStatus>{interconnect}</interconnectStatus><totalCapacity>4</totalCapacity>"
        f"</item></capacityBlockStatusSet>",
    )


def test_the_ultraserver_block_passes(moto_aws):
    record_block(moto_aws, BLOCK)
    check = check_ultraserver_block(Aws(REGION), RESERVATION, group())
    assert check.result == "pass", check.detail
    assert check.detail == f"{RESERVATION} is in u-trn2x64 Capacity Block {BLOCK}, NeuronLink interconnect ok"


def test_a_reservation_outside_any_ultraserver_block_fails_naming_it(moto_aws):
    record_block(moto_aws, None)
    check = check_ultraserver_block(Aws(REGION), RESERVATION, group())
    assert check.result == "fail"
    assert check.detail.startswith(f"{RESERVATION} is in no UltraServer Capacity Block")
    assert "would not share one NeuronLink domain" in check.detail
    assert "capacity.reservationId of trn2-ultra-a" in check.fix


def test_a_block_of_another_ultraserver_type_or_an_impaired_link_fails(moto_aws):
    record_block(moto_aws, BLOCK, ultraserver_type="u-p6e-gb200x36", interconnect="impaired")
    check = check_ultraserver_block(Aws(REGION), RESERVATION, group())
    assert check.result == "fail"
    assert f"Capacity Block {BLOCK} holds UltraServer type u-p6e-gb200x36, not u-trn2x64" in check.detail
    assert f"NeuronLink interconnect of Capacity Block {BLOCK} impaired" in check.detail


def test_an_interconnect_not_yet_reporting_warns(moto_aws):
    record_block(moto_aws, BLOCK, interconnect="insufficient-data")
    check = check_ultraserver_block(Aws(REGION), RESERVATION, group())
    assert check.result == "warn" and "interconnect insufficient-data" in check.detail


def test_preflight_runs_it_and_an_endpoint_without_the_api_warns(moto_aws):
    moto_aws.answer("DescribeCapacityReservationTopology", moto_aws.ec2_error("InvalidAction", "not implemented"))
    steps = [s for s in preflight_steps(load_stack("trn2", ROOT), Aws(REGION)) if s.name.startswith("ultraserver")]
    [check] = run_checks(steps)
    assert check.name == "ultraserver capacity trn2-ultra-a"
    assert check.result == "warn" and "cannot be checked" in check.detail
    assert f"describe-capacity-reservation-topology --capacity-reservation-ids {RESERVATION}" in check.fix


# -- verify: the running instances are one UltraServer --------------------------------------------------


def run_group(name: str, count: int) -> dict[str, str]:
    """`count` trn2u.48xlarge in moto tagged as EKS tags a node group's: instance id -> private DNS name."""
    ec2 = boto3.client("ec2", region_name=REGION)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    run = ec2.run_instances(
        ImageId=image,
        MinCount=count,
        MaxCount=count,
        InstanceType="trn2u.48xlarge",
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "eks:nodegroup-name", "Value": name}]}],
    )
    return {i["InstanceId"]: i["PrivateDnsName"] for i in run["Instances"]}


def record_topology(stub, blocks: dict[str, str | None]) -> None:
    items = "".join(
        f"<item><instanceId>{i}</instanceId><instanceType>trn2u.48xlarge</instanceType>"
        f"<availabilityZone>us-east-2b</availabilityZone><zoneId>use2-az2</zoneId>"
        "<networkNodeSet><item>nn-1</item><item>nn-2</item><item>nn-3</item></networkNodeSet>"
        + (f"<capacityBlockId>{b}</capacityBlockId>" if b else "")
        + "</item>"
        for i, b in blocks.items()
    )
    ec2_answer(stub, "DescribeInstanceTopology", f"<instanceSet>{items}</instanceSet>")


def test_four_instances_of_one_ultraserver_pass(moto_aws):
    name = moto_aws.unique("trn2-ultra-a")
    nodes = run_group(name, 4)
    record_topology(moto_aws, dict.fromkeys(nodes, BLOCK))
    check = check_ultraserver(Aws(REGION), name, 4, "u-trn2x64")
    assert check.result == "pass" and check.detail == f"4 instances in one NeuronLink domain ({BLOCK})"


def test_a_group_over_two_ultraservers_fails_naming_each_ones_nodes(moto_aws):
    name = moto_aws.unique("trn2-ultra-a")
    nodes = run_group(name, 4)
    ids = sorted(nodes)
    record_topology(moto_aws, {ids[0]: BLOCK, ids[1]: BLOCK, ids[2]: OTHER_BLOCK, ids[3]: OTHER_BLOCK})
    check = check_ultraserver(Aws(REGION), name, 4, "u-trn2x64")
    assert check.result == "fail"
    named = {i: f"{nodes[i]} ({i})" for i in ids}
    assert check.detail == (
        f"instances span 2 UltraServer(s): {BLOCK}: {named[ids[0]]}, {named[ids[1]]}; "
        f"{OTHER_BLOCK}: {named[ids[2]]}, {named[ids[3]]}"
    )
    assert "one UltraServer Capacity Block" in check.fix


def test_the_decision_on_recorded_topologies():
    names = {f"i-{n}": f"ip-10-0-1-{n}.us-east-2.compute.internal" for n in range(4)}
    one = [{"InstanceId": i, "CapacityBlockId": BLOCK} for i in names]
    assert ultraserver_problems(one, names, 4, "u-trn2x64") == []
    # An instance EC2 places in no UltraServer, and one the topology answer leaves out, are both outside.
    partial = [{"InstanceId": "i-0", "CapacityBlockId": BLOCK}, {"InstanceId": "i-1", "CapacityBlockId": BLOCK}]
    partial.append({"InstanceId": "i-2"})
    assert ultraserver_problems(partial, names, 4, "u-trn2x64") == [
        f"instances span 1 UltraServer(s): {BLOCK}: {names['i-0']} (i-0), {names['i-1']} (i-1); "
        f"2 outside any: {names['i-2']} (i-2), {names['i-3']} (i-3)"
    ]
    three = {k: names[k] for k in ("i-0", "i-1", "i-2")}
    assert ultraserver_problems(one[:3], three, 4, "u-trn2x64") == ["3 instances running, the u-trn2x64 has 4"]
