"""EFA node groups: launch template interfaces per catalog instance type, placement, capacity
targeting, IMDSv2, encrypted root volumes, user data, labels/taints and the security groups."""

from __future__ import annotations

import base64

import pytest
import yaml
from aws_preview import GPU_GROUP, LT, NODE_GROUP, Stack, preview

from supernode.components.aws.accelerators import ami_parameter
from supernode.core import resource_types as T
from supernode.core.catalog import CATALOG

# What the issue and docs/hardware.md state, written independently of the catalog.
EXPECTED_EFA = {"p4d.24xlarge": 4, "p4de.24xlarge": 4, "p5.48xlarge": 32, "p5e.48xlarge": 32, "p5en.48xlarge": 16}
# The P6 types (docs/hardware.md "Network cards"): (card, device) -> interface type, every slot.
P6_LAYOUTS = {
    # 8 cards, each EFA-capable: ENA primary, efa-only beside it on card 0, efa-only at device 0 elsewhere
    "p6-b200.48xlarge": {(0, 0): "interface", (0, 1): "efa-only", **{(c, 0): "efa-only" for c in range(1, 8)}},
    # 17 cards, card 0 ENA-only: 16 EFA on cards 1..16
    "p6-b300.48xlarge": {(0, 0): "interface", **{(c, 0): "efa-only" for c in range(1, 17)}},
    # card 0 must be `interface`; 4 EFA devices per node (EKS UltraServer guide)
    "p6e-gb200.36xlarge": {(0, 0): "interface", **{(c, 0): "efa-only" for c in range(1, 5)}},
}
# Trainium2 (EC2 via moto: 16 network cards of 200 Gb/s, every card EFA-capable, MaximumEfaInterfaces 16):
# ENA primary with efa-only beside it on card 0, efa-only at device 0 on cards 1..15.
TRN2_LAYOUTS = {
    t: {(0, 0): "interface", (0, 1): "efa-only", **{(c, 0): "efa-only" for c in range(1, 16)}}
    for t in ("trn2.48xlarge", "trn2u.48xlarge")
}
SG_IN = T.SG_INGRESS
SG_OUT = T.SG_EGRESS
PG = T.PLACEMENT_GROUP
SCHEDULE = T.ASG_SCHEDULE


def with_instance_type(instance_type: str):
    def change(data: dict) -> None:
        for g in data["acceleratorNodeGroups"]:
            g["instanceType"] = instance_type

    return change


def test_catalog_covers_the_expected_types():
    assert set(EXPECTED_EFA) | set(P6_LAYOUTS) | set(TRN2_LAYOUTS) == set(CATALOG)


def p6_template(instance_type: str):
    """The launch template of the stack that runs the type: gb200, b300, and b300 on p6-b200."""
    if instance_type == "p6e-gb200.36xlarge":
        return preview("gb200").gpu_launch_templates()["nvl72-a"]
    s = preview("b300", instance_type, with_instance_type(instance_type))
    return s.gpu_launch_templates()["gpu-b300"]


@pytest.mark.parametrize("instance_type", sorted(P6_LAYOUTS))
def test_p6_launch_templates_follow_the_card_layout(instance_type):
    lt = p6_template(instance_type)
    nics = lt.inputs["networkInterfaces"]
    slots = {(int(n["networkCardIndex"]), int(n["deviceIndex"])): n["interfaceType"] for n in nics}
    assert len(slots) == len(nics) and slots == P6_LAYOUTS[instance_type]
    assert lt.inputs["instanceType"] == instance_type


def test_p6_b300_has_17_interfaces_with_card_0_ena_only():
    nics = p6_template("p6-b300.48xlarge").inputs["networkInterfaces"]
    assert len(nics) == 17
    assert [n["interfaceType"] for n in nics if int(n["networkCardIndex"]) == 0] == ["interface"]
    assert sum(n["interfaceType"] == "efa-only" for n in nics) == 16


@pytest.mark.parametrize("stack_name", ["dev", "prod"])
@pytest.mark.parametrize("instance_type", sorted(EXPECTED_EFA))  # the P6 types: above
def test_launch_template_has_one_interface_per_network_card(stack_name, instance_type):
    s = preview(stack_name, instance_type, with_instance_type(instance_type))
    efa_sg = s.outputs["efa_security_group_id"]
    templates = s.gpu_launch_templates()
    assert set(templates) == {g.name for g in s.cfg.accelerator_node_groups}
    for lt in templates.values():
        assert lt.inputs["instanceType"] == instance_type
        nics = lt.inputs["networkInterfaces"]
        efa = [n for n in nics if n["interfaceType"] in ("efa", "efa-only")]
        assert len(efa) == EXPECTED_EFA[instance_type]
        # one EFA device on every network card, none twice
        assert sorted(int(n["networkCardIndex"]) for n in efa) == list(range(EXPECTED_EFA[instance_type]))
        slots = {(int(n["networkCardIndex"]), int(n["deviceIndex"])): n["interfaceType"] for n in nics}
        assert len(slots) == len(nics), "two interfaces share a card/device slot"
        if CATALOG[instance_type].ena_primary:  # p5en: ENA primary, EFA-only beside it on card 0
            assert slots[(0, 0)] == "interface" and slots[(0, 1)] == "efa-only"
            assert len(nics) == EXPECTED_EFA[instance_type] + 1
        else:
            assert slots[(0, 0)] == "efa" and len(nics) == EXPECTED_EFA[instance_type]
        for card in range(1, EXPECTED_EFA[instance_type]):
            assert slots[(card, 1)] == "efa-only"
        for n in nics:
            assert efa_sg in n["securityGroups"] and n["deleteOnTermination"] is True
            assert "subnetId" not in n  # the node group places instances in the GPU subnet


def test_the_catalog_interface_layout_matches_the_facts():
    b300 = CATALOG["p6-b300.48xlarge"].network_interfaces
    assert [(s.network_card_index, s.device_index, s.interface_type) for s in b300[:3]] == [
        (0, 0, "interface"),
        (1, 0, "efa-only"),
        (2, 0, "efa-only"),
    ]
    p5en = CATALOG["p5en.48xlarge"].network_interfaces
    assert [(s.network_card_index, s.device_index, s.interface_type) for s in p5en[:3]] == [
        (0, 0, "interface"),
        (0, 1, "efa-only"),
        (1, 1, "efa-only"),
    ]
    assert [s.interface_type for s in CATALOG["p4d.24xlarge"].network_interfaces] == ["efa"] + ["efa-only"] * 3
    # the cards the policy pack wants an EFA interface on: every card, or 1..n where card 0 is ENA-only
    assert CATALOG["p5en.48xlarge"].efa_cards == list(range(16))
    assert CATALOG["p6-b300.48xlarge"].efa_cards == list(range(1, 17))


def test_placement_group_is_cluster_for_on_demand():
    s = preview("dev")
    groups = s.all(GPU_GROUP)
    pgs = s.all(PG)
    assert len(pgs) == len(groups) == 2  # training's group and serving's (role: serving), each on-demand
    assert pgs[0].inputs["strategy"] == "cluster"
    lt = s.gpu_launch_templates()["gpu-p5"]
    assert lt.inputs["placement"]["groupName"] == pgs[0].outputs["name"]
    assert "capacityReservationSpecification" not in lt.inputs


def test_reservation_targeted_without_placement_group():
    s = preview("prod")
    assert s.all(PG) == []
    for g in s.cfg.accelerator_node_groups:
        lt = s.gpu_launch_templates()[g.name]
        assert "placement" not in lt.inputs
        target = lt.inputs["capacityReservationSpecification"]["capacityReservationTarget"]
        assert target["capacityReservationId"] == g.capacity.reservation_id
        assert "instanceMarketOptions" not in lt.inputs
        assert s.one(NODE_GROUP, g.name).inputs["capacityType"] == "ON_DEMAND"


def test_capacity_block_uses_its_market_type():
    def change(data: dict) -> None:
        for g in data["acceleratorNodeGroups"]:
            g["capacity"] |= {"type": "capacity-block", "endsAt": "2027-03-01T05:30:00-06:00"}  # 11:30 UTC

    s = preview("prod", "capacity-block", change)
    assert s.all(PG) == []
    for g in s.cfg.accelerator_node_groups:
        lt = s.gpu_launch_templates()[g.name]
        assert lt.inputs["instanceMarketOptions"]["marketType"] == "capacity-block"
        assert (
            lt.inputs["capacityReservationSpecification"]["capacityReservationTarget"]["capacityReservationId"]
            == g.capacity.reservation_id
        )
        assert s.one(NODE_GROUP, g.name).inputs["capacityType"] == "CAPACITY_BLOCK"
    # The block's end given with an offset: the scale to 0 is still 40 min before it, in UTC.
    assert {r.inputs["startTime"] for r in s.all(SCHEDULE)} == {"2027-03-01T10:50:00Z"}


def test_capacity_block_groups_scale_to_zero_40_minutes_before_the_block_ends():
    """docs/hardware.md: instances terminate from 30 min before the end; EKS wants 0 nodes by 40 min before.
    Every capacity-block group has one schedule, on its own node group's Auto Scaling group."""
    s = preview("gb200")
    groups = s.all(GPU_GROUP)
    assert len(groups) == 2 and len(s.all(SCHEDULE)) == 2
    for grp, g in zip(groups, s.cfg.accelerator_node_groups):
        assert g.capacity.type == "capacity-block"
        (schedule,) = s.children(grp, SCHEDULE)
        asg = s.one(NODE_GROUP, g.name).outputs["resources"][0]["autoscalingGroups"][0]["name"]
        assert schedule.inputs == {
            "scheduledActionName": f"{g.name}-capacity-block-end",
            "autoscalingGroupName": asg,
            "minSize": 0,
            "maxSize": 0,
            "desiredCapacity": 0,
            # Pulumi.gb200.yaml: endsAt 2027-01-14T11:30:00Z
            "startTime": "2027-01-14T10:50:00Z",
        }
    assert s.all(SCHEDULE)[0].inputs["autoscalingGroupName"] != s.all(SCHEDULE)[1].inputs["autoscalingGroupName"]
    assert preview("prod").all(SCHEDULE) == []  # no block, nothing ends


def test_placement_group_can_be_forced_on_with_a_reservation():
    def change(data: dict) -> None:
        data["acceleratorNodeGroups"][0]["placementGroup"] = True

    s = preview("prod", "reservation+pg", change)
    assert [p.inputs["strategy"] for p in s.all(PG)] == ["cluster"]


def test_every_launch_template_requires_imdsv2_and_encrypts_root(stack: Stack):
    templates = stack.all(LT)
    assert len(templates) == len(stack.cfg.accelerator_node_groups) + 1  # + system
    for lt in templates:
        md = lt.inputs["metadataOptions"]
        assert md["httpTokens"] == "required" and md["httpEndpoint"] == "enabled"
        assert md["httpPutResponseHopLimit"] == 1  # the node only: no pod reaches the node role (issue 19)
        root = lt.inputs["blockDeviceMappings"]
        assert root and all(b["ebs"]["encrypted"] == "true" for b in root)
        assert "keyName" not in lt.inputs  # no SSH keys: SSM only


def test_gpu_node_groups_labels_taints_subnet_and_repair(stack: Stack):
    gpu_subnet = stack.outputs["gpu_subnet_id"]
    for g in stack.cfg.accelerator_node_groups:
        ng = stack.one(NODE_GROUP, g.name).inputs
        assert ng["nodeGroupName"] == g.name and ng["subnetIds"] == [gpu_subnet]
        # the GPU taint, and unchecked until the node health agent's deep check passes
        assert ng["taints"] == [
            {"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"},
            {"key": "supernode.io/unchecked", "value": "true", "effect": "NO_SCHEDULE"},
        ]
        assert ng["labels"]["vpc.amazonaws.com/efa.present"] == "true"
        assert ng["labels"]["supernode.io/node-group"] == g.name
        size = g.nodes + g.spares  # the spares boot beside the world's nodes
        assert ng["scalingConfig"] == {"minSize": size, "desiredSize": size, "maxSize": size}
        assert ng["nodeRepairConfig"]["enabled"] is True
        assert ng["launchTemplate"]["id"] == stack.gpu_launch_templates()[g.name].id
        assert ng["nodeRoleArn"].endswith(":role/" + stack.one(T.IAM_ROLE, "node-role").outputs["name"])
    assert stack.outputs["node_group_names"] == [g.name for g in stack.cfg.accelerator_node_groups]


def test_user_data_joins_with_nodeadm_raid0_and_the_same_labels(stack: Stack):
    for g in stack.cfg.accelerator_node_groups:
        lt = stack.gpu_launch_templates()[g.name].inputs
        assert lt["imageId"].startswith("ami-")
        text = base64.b64decode(lt["userData"]).decode()
        node_config = yaml.safe_load(text.split("Content-Type: application/node.eks.aws\n\n", 1)[1].split("\n--", 1)[0])
        spec = node_config["spec"]
        assert node_config["kind"] == "NodeConfig"
        assert spec["cluster"]["name"] == stack.outputs["cluster_name"]
        assert spec["cluster"]["apiServerEndpoint"] == stack.outputs["cluster_endpoint"]
        assert spec["instance"]["localStorage"]["strategy"] == "RAID0"
        flags = spec["kubelet"]["flags"]
        assert "--register-with-taints=nvidia.com/gpu=true:NoSchedule,supernode.io/unchecked=true:NoSchedule" in flags
        labels = stack.one(NODE_GROUP, g.name).inputs["labels"]
        assert f"--node-labels={','.join(f'{k}={v}' for k, v in sorted(labels.items()))}" in flags
        assert f"vm.nr_hugepages = {stack.cfg.workload.hugepages_2mi_gib * 512}" in text


def test_ami_parameter_pins_the_release():
    assert ami_parameter("1.33", "1.33.5-20251120") == (
        "/aws/service/eks/optimized-ami/1.33/amazon-linux-2023/x86_64/nvidia/"
        "amazon-eks-node-al2023-x86_64-nvidia-1.33-v20251120/image_id"
    )


def test_gb200_takes_the_arm64_nvidia_ami():
    assert ami_parameter("1.33", "1.33.5-20251120", CATALOG["p6e-gb200.36xlarge"].arch) == (
        "/aws/service/eks/optimized-ami/1.33/amazon-linux-2023/arm64/nvidia/"
        "amazon-eks-node-al2023-arm64-nvidia-1.33-v20251120/image_id"
    )
    assert {CATALOG[t].arch for t in CATALOG if t != "p6e-gb200.36xlarge"} == {"x86_64"}


def test_ultraserver_groups_buy_capacity_blocks_and_label_their_domain():
    s = preview("gb200")
    assert s.all(PG) == []  # Capacity Blocks are already co-located
    for g in s.cfg.accelerator_node_groups:
        lt = s.gpu_launch_templates()[g.name]
        assert lt.inputs["instanceMarketOptions"]["marketType"] == "capacity-block"
        assert (
            lt.inputs["capacityReservationSpecification"]["capacityReservationTarget"]["capacityReservationId"]
            == g.capacity.reservation_id
        )
        ng = s.one(NODE_GROUP, g.name).inputs
        assert ng["capacityType"] == "CAPACITY_BLOCK" and ng["scalingConfig"]["desiredSize"] == 18
        assert ng["labels"]["supernode.io/nvlink-domain"] == g.name
        assert ng["labels"]["supernode.io/ultraserver"] == "u-p6e-gb200x72"
    assert "supernode.io/nvlink-domain" not in preview("dev").one(NODE_GROUP, "gpu-p5").inputs["labels"]


def test_system_node_group(stack: Stack):
    sys_ng = stack.one(NODE_GROUP, "accelerators-system").inputs
    s = stack.cfg.system_node_group
    assert sys_ng["instanceTypes"] == [s.instance_type]
    assert sys_ng["scalingConfig"] == {"minSize": s.min_size, "desiredSize": s.desired_size, "maxSize": s.max_size}
    assert sys_ng["subnetIds"] == stack.outputs["private_subnet_ids"]
    assert sys_ng["releaseVersion"] == stack.cfg.accelerator_node_groups[0].ami_release_version
    assert "taints" not in sys_ng


def test_efa_security_group_is_self_referencing_both_ways(stack: Stack):
    sg = stack.outputs["efa_security_group_id"]
    rules = {t: [r.inputs for r in stack.all(t) if r.inputs["securityGroupId"] == sg] for t in (SG_IN, SG_OUT)}
    for t in (SG_IN, SG_OUT):
        assert rules[t] == [{**rules[t][0], "ipProtocol": "-1", "referencedSecurityGroupId": sg}]
        assert "cidrIpv4" not in rules[t][0]


def test_fsx_ports_open_from_the_nodes_only(stack: Stack):
    node_sg = stack.outputs["efa_security_group_id"]
    fsx_sg = stack.one(T.SECURITY_GROUP, "storage-fsx").id
    assert stack.one(T.FSX_LUSTRE).inputs["securityGroupIds"] == [fsx_sg]
    ingress = [r.inputs for r in stack.all(SG_IN) if r.inputs["securityGroupId"] == fsx_sg]
    assert all("cidrIpv4" not in r and r["referencedSecurityGroupId"] in (node_sg, fsx_sg) for r in ingress)
    from_nodes = {
        (r["ipProtocol"], r["fromPort"], r["toPort"]) for r in ingress if r["referencedSecurityGroupId"] == node_sg
    }
    assert from_nodes == {("tcp", 988, 988), ("tcp", 1018, 1023)}
