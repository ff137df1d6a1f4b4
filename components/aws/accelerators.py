"""Accelerator node groups with EFA, and the small system node group (issue 3, part 3).

Each launch template carries the catalog's interface layout (InstanceType.network_interfaces, after
docs/hardware.md "Network cards"): one interface per network card, the EFA ones on the cards
the policy pack checks.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import yaml

from supernode.core.catalog import CATALOG
from supernode.core.config import AcceleratorNodeGroup, Capacity, SystemNodeGroup
from supernode.core.host import AMAZON_TIME_SYNC, HOST_SYSCTLS, NOFILE
from supernode.core.pools import ROLE_LABEL
from supernode.core.vendors import VENDORS

from ..context import StackContext
from ..taints import UNCHECKED, Taint

# Each vendor's accelerator taint (supernode.core.vendors: its key).
ACCELERATOR_TAINTS = {name: Taint(row.taint_key, "true", "NoSchedule") for name, row in VENDORS.items()}
GPU_TAINT, NEURON_TAINT = ACCELERATOR_TAINTS["nvidia"], ACCELERATOR_TAINTS["neuron"]
ROOT_VOLUME_GIB = 200  # the NVIDIA AMI and container images; training data lives on NVMe and FSx
SYSTEM_ROOT_VOLUME_GIB = 50
# IMDSv2 only, hop limit 1: a pod in its own network namespace cannot reach the node's credentials.
# What needs AWS from a pod uses IRSA (docs/security.md); the CloudWatch agent runs in the host
# network (the add-on's default since 2024), where hop limit 1 still reaches instance metadata.
IMDS = aws.ec2.LaunchTemplateMetadataOptionsArgs(
    http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=1, instance_metadata_tags="disabled"
)
AWS_TIME = "%Y-%m-%dT%H:%M:%SZ"  # a scheduled action's start time, in UTC
CAPACITY_TYPES = {"on-demand": "ON_DEMAND", "capacity-reservation": "ON_DEMAND", "capacity-block": "CAPACITY_BLOCK"}
_TAINT_EFFECTS = {"NoSchedule": "NO_SCHEDULE", "NoExecute": "NO_EXECUTE", "PreferNoSchedule": "PREFER_NO_SCHEDULE"}


# Nodes of one NVLink domain share this label (the node group: one group is one UltraServer). GPU
# Feature Discovery adds `nvidia.com/gpu.clique` at run time, which the job's pod affinity uses.
DOMAIN_LABEL = "supernode.io/nvlink-domain"


def node_labels(group: AcceleratorNodeGroup) -> dict[str, str]:
    hw = CATALOG[group.instance_type]
    labels = {
        "supernode.io/node-group": group.name,
        "supernode.io/accelerator": hw.accelerator,
        ROLE_LABEL: group.role,  # training | serving: Kueue's flavors (k8s/queues.py) select on it
        "supernode.io/capacity": group.capacity.type,
        hw.vendor_row.present_label: "true",
        "vpc.amazonaws.com/efa.present": "true",
    }
    if group.ultra_server:
        labels |= {DOMAIN_LABEL: group.name, "supernode.io/ultraserver": group.ultra_server}
    return labels


def node_taints(group: AcceleratorNodeGroup) -> list[Taint]:
    """The group's vendor taint, and for a vendor with the node health agent the unchecked taint a node
    joins with (until the agent's deep check passes)."""
    hw = CATALOG[group.instance_type]
    return [ACCELERATOR_TAINTS[hw.vendor], *([UNCHECKED] if hw.vendor_row.node_agent else [])]


def ami_parameter(kubernetes_version: str, release: str, arch: str = "x86_64", vendor: str = "nvidia") -> str:
    """SSM parameter of the EKS-optimised AL2023 accelerated AMI for one release (1.33.5-20251120), CPU
    architecture (x86_64, or arm64 for the Grace CPUs of p6e-gb200; docs/hardware.md "EKS") and
    vendor: the NVIDIA AMI, or the Neuron AMI for Trainium (amazon-eks-node-al2023-x86_64-neuron-...)."""
    date, variant = release.rsplit("-", 1)[1], VENDORS[vendor].ami_variant
    return (
        f"/aws/service/eks/optimized-ami/{kubernetes_version}/amazon-linux-2023/{arch}/{variant}/"
        f"amazon-eks-node-al2023-{arch}-{variant}-{kubernetes_version}-v{date}/image_id"
    )


def host_baseline_script(hugepages_2mi: int) -> str:
    """Bootstrap shell for the core's host baseline (supernode.core.host, which the node inventory
    checks): sysctls (persisted), nofile/memlock limits for logins and for containerd (its
    pods inherit them: EFA locks memory without bound), and chrony on Amazon Time Sync. Runs before
    nodeadm starts containerd and kubelet, so they start with these settings."""
    sysctls = {"vm.nr_hugepages": hugepages_2mi, **HOST_SYSCTLS}
    conf = "".join(f"{k} = {v}\n" for k, v in sysctls.items())
    return (
        "#!/bin/bash\nset -euo pipefail\n"
        f"cat > /etc/sysctl.d/99-supernode.conf <<'EOF'\n{conf}EOF\nsysctl -e -p /etc/sysctl.d/99-supernode.conf\n"
        "cat > /etc/security/limits.d/99-supernode.conf <<'EOF'\n"
        f"* soft nofile {NOFILE}\n* hard nofile {NOFILE}\n* soft memlock unlimited\n* hard memlock unlimited\nEOF\n"
        "mkdir -p /etc/systemd/system/containerd.service.d\n"
        "cat > /etc/systemd/system/containerd.service.d/99-supernode-limits.conf <<'EOF'\n"
        f"[Service]\nLimitNOFILE={NOFILE}\nLimitMEMLOCK=infinity\nEOF\nsystemctl daemon-reload\n"
        # The AMI points chrony at Amazon Time Sync; make sure, then wait briefly for sync. A slow sync
        # does not fail the boot: the inventory reports the offset and flags it beyond the bound.
        f"grep -q '{AMAZON_TIME_SYNC[0]}' /etc/chrony.conf /etc/chrony.d/* 2>/dev/null || {{ "
        f"echo 'server {AMAZON_TIME_SYNC[0]} prefer iburst minpoll 4 maxpoll 4' >> /etc/chrony.conf; "
        "systemctl restart chronyd; }\n"
        "chronyc waitsync 6 0.01 || echo 'supernode: chrony not yet within 10 ms of Amazon Time Sync' >&2\n"
    )


def nodeadm_user_data(
    cluster_name: str,
    endpoint: str,
    ca_data: str,
    service_cidr: str,
    labels: Mapping[str, str],
    taints: Sequence[Taint],
    hugepages_2mi: int,
) -> str:
    """MIME user data: nodeadm NodeConfig (a custom AMI joins with it) with the local NVMe as RAID0,
    and the host baseline (host_baseline_script): the 2 MiB huge pages EFA pods request, sysctls,
    limits and time sync, set before kubelet starts and advertises them."""
    node_config = {
        "apiVersion": "node.eks.aws/v1alpha1",
        "kind": "NodeConfig",
        "spec": {
            "cluster": {
                "name": cluster_name,
                "apiServerEndpoint": endpoint,
                "certificateAuthority": ca_data,
                "cidr": service_cidr,
            },
            "instance": {"localStorage": {"strategy": "RAID0"}},
            "kubelet": {
                "flags": [
                    "--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
                    "--register-with-taints=" + ",".join(t.kubelet_flag() for t in taints),
                ]
            },
        },
    }
    boundary = "SUPERNODE"
    text = (
        f'MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary="{boundary}"\n\n'
        f"--{boundary}\nContent-Type: application/node.eks.aws\n\n{yaml.safe_dump(node_config, sort_keys=False)}\n"
        f'--{boundary}\nContent-Type: text/x-shellscript; charset="us-ascii"\n\n'
        f"{host_baseline_script(hugepages_2mi)}\n--{boundary}--\n"
    )
    return base64.b64encode(text.encode()).decode()


def decode_user_data(encoded: str) -> str:
    return base64.b64decode(encoded).decode()


@dataclass
class AcceleratorsArgs:
    ctx: StackContext
    kubernetes_version: str
    groups: Sequence[AcceleratorNodeGroup]
    system: SystemNodeGroup
    cluster_name: pulumi.Input[str]
    cluster_endpoint: pulumi.Input[str]
    cluster_certificate_authority: pulumi.Input[str]
    cluster_security_group_id: pulumi.Input[str]
    service_cidr: str
    vpc_id: pulumi.Input[str]
    gpu_subnet_id: pulumi.Input[str]
    system_subnet_ids: Sequence[pulumi.Input[str]]
    node_role_arn: pulumi.Input[str]
    hugepages_2mi_gib: int
    node_dependencies: Sequence[pulumi.Resource] = ()  # e.g. the CNI add-on nodes need to become ready


class GpuNodeGroup(pulumi.ComponentResource):
    """One accelerator node group: placement group, EFA launch template, managed node group, and on a
    Capacity Block the scheduled scale to 0 before the block ends."""

    def __init__(
        self,
        name: str,
        group: AcceleratorNodeGroup,
        args: AcceleratorsArgs,
        efa_security_group_id: pulumi.Input[str],
        opts: pulumi.ResourceOptions | None = None,
    ):
        super().__init__("supernode:accelerators:GpuNodeGroup", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.labels, self.taints = node_labels(group), node_taints(group)

        self.launch_template = _launch_template(
            name, group, args, efa_security_group_id, self.labels, self.taints, child
        )
        self.node_group = _node_group(name, group, args, self.launch_template, self.labels, self.taints, child)
        self.name_output = self.node_group.node_group_name
        self.scale_to_zero = _scale_to_zero(name, group, self.node_group, child)
        self.register_outputs({"node_group_name": self.name_output, "launch_template_id": self.launch_template.id})


def _launch_template(
    name: str,
    group: AcceleratorNodeGroup,
    args: AcceleratorsArgs,
    efa_security_group_id: pulumi.Input[str],
    labels: Mapping[str, str],
    taints: Sequence[Taint],
    child: pulumi.ResourceOptions,
) -> aws.ec2.LaunchTemplate:
    """The group's launch template: the accelerated AMI, nodeadm user data, the EFA interfaces, the
    placement group and the capacity it launches into."""
    hw, tags = CATALOG[group.instance_type], args.ctx.tagged()
    placement = None
    if group.use_placement_group:
        pg = aws.ec2.PlacementGroup(name, strategy="cluster", tags=tags, opts=child)
        placement = aws.ec2.LaunchTemplatePlacementArgs(group_name=pg.name)
    reservation, market = _capacity_options(group.capacity)
    # EKS would attach the cluster SG itself, but not when the template lists interfaces.
    security_groups = [efa_security_group_id, args.cluster_security_group_id]
    interfaces = [
        aws.ec2.LaunchTemplateNetworkInterfaceArgs(
            network_card_index=s.network_card_index,
            device_index=s.device_index,
            interface_type=s.interface_type,
            security_groups=security_groups,
            delete_on_termination=True,
        )
        for s in hw.network_interfaces
    ]
    ami = aws.ssm.get_parameter_output(
        name=ami_parameter(args.kubernetes_version, group.ami_release_version, hw.arch, hw.vendor),
        opts=pulumi.InvokeOutputOptions(parent=child.parent),
    )
    user_data = pulumi.Output.all(args.cluster_name, args.cluster_endpoint, args.cluster_certificate_authority).apply(
        lambda a: nodeadm_user_data(a[0], a[1], a[2], args.service_cidr, labels, taints, args.hugepages_2mi_gib * 512)
    )
    return aws.ec2.LaunchTemplate(
        name,
        instance_type=group.instance_type,
        image_id=ami.value,
        user_data=user_data,
        network_interfaces=interfaces,
        placement=placement,
        capacity_reservation_specification=reservation,
        instance_market_options=market,
        metadata_options=IMDS,
        ebs_optimized="true",
        block_device_mappings=[_root_volume(ROOT_VOLUME_GIB)],
        update_default_version=True,
        tag_specifications=[
            aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=r, tags=tags)
            for r in ("instance", "volume", "network-interface")
        ],
        tags=tags,
        opts=child,
    )


def _capacity_options(
    cap: Capacity,
) -> tuple[
    aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs | None,
    aws.ec2.LaunchTemplateInstanceMarketOptionsArgs | None,
]:
    """The launch template's (capacity reservation, market options): the reservation it targets
    unless on demand, and the capacity-block market on a Capacity Block."""
    reservation = market = None
    if cap.type != "on-demand":
        reservation = aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs(
            capacity_reservation_target=aws.ec2.LaunchTemplateCapacityReservationSpecificationCapacityReservationTargetArgs(
                capacity_reservation_id=cap.reservation_id
            )
        )
    if cap.type == "capacity-block":
        market = aws.ec2.LaunchTemplateInstanceMarketOptionsArgs(market_type="capacity-block")
    return reservation, market


def _node_group(
    name: str,
    group: AcceleratorNodeGroup,
    args: AcceleratorsArgs,
    launch_template: aws.ec2.LaunchTemplate,
    labels: Mapping[str, str],
    taints: Sequence[Taint],
    child: pulumi.ResourceOptions,
) -> aws.eks.NodeGroup:
    """The managed node group of `launch_template` in the GPU subnet, at its fixed size."""
    return aws.eks.NodeGroup(
        name,
        cluster_name=args.cluster_name,
        node_group_name=group.name,
        node_role_arn=args.node_role_arn,
        subnet_ids=[args.gpu_subnet_id],
        capacity_type=CAPACITY_TYPES[group.capacity.type],
        # The group's nodes and its spares: a spare boots and passes the join checks like any node
        # (outside the job's world), so a failed node's pod lands on it at once.
        scaling_config=aws.eks.NodeGroupScalingConfigArgs(
            min_size=group.instances, desired_size=group.instances, max_size=group.instances
        ),
        launch_template=aws.eks.NodeGroupLaunchTemplateArgs(
            id=launch_template.id, version=launch_template.latest_version.apply(str)
        ),
        labels=labels,
        taints=[_eks_taint(t) for t in taints],
        update_config=aws.eks.NodeGroupUpdateConfigArgs(max_unavailable=1),
        node_repair_config=aws.eks.NodeGroupNodeRepairConfigArgs(enabled=True),
        tags=args.ctx.tagged(),
        opts=pulumi.ResourceOptions(parent=child.parent, depends_on=list(args.node_dependencies)),
    )


def _scale_to_zero(
    name: str, group: AcceleratorNodeGroup, node_group: aws.eks.NodeGroup, child: pulumi.ResourceOptions
) -> aws.autoscaling.Schedule | None:
    """On a Capacity Block, the scheduled scale to 0 before the block ends; None otherwise."""
    at = group.capacity.scale_to_zero_at
    if at is None:
        return None
    # The Capacity Block's end: 0 nodes before EC2 terminates them, so the pods drain (the trainer
    # checkpoints on SIGTERM). On the group's Auto Scaling group, which EKS creates.
    return aws.autoscaling.Schedule(
        f"{name}-block-end",
        scheduled_action_name=f"{group.name}-capacity-block-end",
        autoscaling_group_name=node_group.resources.apply(lambda rs: rs[0].autoscaling_groups[0].name),
        start_time=at.strftime(AWS_TIME),
        min_size=0,
        max_size=0,
        desired_capacity=0,
        opts=child,
    )


class Accelerators(pulumi.ComponentResource):
    """Every accelerator node group, the EFA security group and the system node group."""

    gpu_groups: list[GpuNodeGroup]
    efa_security_group_id: pulumi.Output[str]

    def __init__(self, name: str, args: AcceleratorsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:accelerators:Accelerators", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = args.ctx.tagged()
        sg = aws.ec2.SecurityGroup(
            f"{name}-efa",
            vpc_id=args.vpc_id,
            description="EFA: all traffic among GPU nodes",
            tags=args.ctx.tagged({"Name": f"supernode-{args.ctx.stack}-efa"}),
            opts=child,
        )
        # EFA's OS-bypass traffic needs every protocol between members, in both directions.
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-efa-in-self",
            security_group_id=sg.id,
            ip_protocol="-1",
            referenced_security_group_id=sg.id,
            description="EFA from GPU nodes",
            opts=child,
        )
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-efa-out-self",
            security_group_id=sg.id,
            ip_protocol="-1",
            referenced_security_group_id=sg.id,
            description="EFA to GPU nodes",
            opts=child,
        )
        self.efa_security_group_id = sg.id
        self.gpu_groups = [GpuNodeGroup(g.name, g, args, sg.id, opts=child) for g in args.groups]

        sys_lt = aws.ec2.LaunchTemplate(
            f"{name}-system",
            metadata_options=IMDS,
            block_device_mappings=[_root_volume(SYSTEM_ROOT_VOLUME_GIB)],
            update_default_version=True,
            tags=tags,
            opts=child,
        )
        s = args.system
        self.system_node_group = aws.eks.NodeGroup(
            f"{name}-system",
            cluster_name=args.cluster_name,
            node_group_name="system",
            node_role_arn=args.node_role_arn,
            subnet_ids=list(args.system_subnet_ids),
            ami_type="AL2023_x86_64_STANDARD",
            release_version=args.groups[0].ami_release_version,
            instance_types=[s.instance_type],
            capacity_type="ON_DEMAND",
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(
                min_size=s.min_size, desired_size=s.desired_size, max_size=s.max_size
            ),
            launch_template=aws.eks.NodeGroupLaunchTemplateArgs(id=sys_lt.id, version=sys_lt.latest_version.apply(str)),
            labels={"supernode.io/role": "system"},
            update_config=aws.eks.NodeGroupUpdateConfigArgs(max_unavailable=1),
            node_repair_config=aws.eks.NodeGroupNodeRepairConfigArgs(enabled=True),
            tags=tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.node_dependencies)),
        )
        self.node_group_names = [g.name_output for g in self.gpu_groups]
        self.labels = {g.name: grp.labels for g, grp in zip(args.groups, self.gpu_groups)}
        self.taints = {g.name: grp.taints for g, grp in zip(args.groups, self.gpu_groups)}
        self.register_outputs(
            {"node_group_names": self.node_group_names, "efa_security_group_id": self.efa_security_group_id}
        )

    @property
    def node_groups(self) -> list[aws.eks.NodeGroup]:
        return [g.node_group for g in self.gpu_groups] + [self.system_node_group]


def _root_volume(gib: int) -> aws.ec2.LaunchTemplateBlockDeviceMappingArgs:
    # Encrypted with the account's aws/ebs key: a customer key here would need grants for the Auto
    # Scaling service-linked role, which EKS managed node groups launch through.
    return aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
        device_name="/dev/xvda",
        ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
            volume_size=gib, volume_type="gp3", encrypted="true", delete_on_termination="true"
        ),
    )


def _eks_taint(t: Taint) -> aws.eks.NodeGroupTaintArgs:
    return aws.eks.NodeGroupTaintArgs(key=t.key, value=t.value, effect=_TAINT_EFFECTS[t.effect])
