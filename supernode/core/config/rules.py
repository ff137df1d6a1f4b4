"""Rules across fields of a StackConfig: region and AZs, network, node groups, storage, and the
parallel layout (through the one layout validator, `supernode.core.layout`)."""

from __future__ import annotations

import ipaddress

from pydantic import ValidationError

from ..catalog import CATALOG, EKS_ADDON_VERSIONS, LOCAL_ZONES, REGION_AZS, ULTRASERVERS, ultraserver_only
from ..errors import Issue
from ..layout import P, layout_rules
from ..teams import namespace as team_namespace
from .schema import StackConfig, issues_from_validation


def _nets(paths_cidrs: list[tuple[str, str]], issues: list[Issue]) -> list[tuple[str, ipaddress.IPv4Network]]:
    nets = []
    for path, cidr in paths_cidrs:
        try:
            nets.append((path, ipaddress.IPv4Network(cidr, strict=True)))
        except ValueError as e:
            issues.append(Issue(path=path, value=cidr, message=f"not a valid IPv4 CIDR ({e}); e.g. 10.0.0.0/16"))
    return nets


def _created_vpc_rules(c: StackConfig, vpc: ipaddress.IPv4Network | None) -> list[Issue]:
    """The stack creates the VPC: its subnets come from the *Cidrs keys, inside vpcCidr, disjoint."""
    net = c.network
    issues = _created_subnet_keys(c)
    subnets = _nets(
        [(f"{P}network.privateSubnetCidrs[{i}]", s) for i, s in enumerate(net.private_subnet_cidrs)]
        + [(f"{P}network.publicSubnetCidrs[{i}]", s) for i, s in enumerate(net.public_subnet_cidrs)]
        + ([(P + "network.gpuSubnetCidr", net.gpu_subnet_cidr)] if net.gpu_subnet_cidr is not None else []),
        issues,
    )
    return issues + _subnets_inside_and_disjoint(subnets, vpc)


def _created_subnet_keys(c: StackConfig) -> list[Issue]:
    """A created VPC's subnet keys: no existing*SubnetId, one private (and none or one public)
    subnet CIDR per availability zone, a gpuSubnetCidr, and public subnets for a NAT gateway."""
    net, issues = c.network, []
    azs = len(net.availability_zones)
    for key, value in (
        ("existingPrivateSubnetIds", net.existing_private_subnet_ids),
        ("existingGpuSubnetId", net.existing_gpu_subnet_id),
    ):
        if value:
            issues.append(
                Issue(
                    path=f"{P}network.{key}",
                    value=value,
                    message="existing subnets need network.existingVpcId (their VPC); set it, "
                    "or remove this key to let the stack create the subnets",
                )
            )
    if not net.private_subnet_cidrs:
        issues.append(
            Issue(
                path=P + "network.privateSubnetCidrs",
                value=net.private_subnet_cidrs,
                missing="private_subnet_cidrs" not in net.model_fields_set,
                message=f"required unless network.existingVpcId is set: one CIDR inside vpcCidr "
                f"per availability zone ({azs})",
            )
        )
    elif len(net.private_subnet_cidrs) != azs:
        issues.append(
            Issue(
                path=P + "network.privateSubnetCidrs",
                value=net.private_subnet_cidrs,
                message=f"need one private subnet per availability zone ({azs})",
            )
        )
    if net.gpu_subnet_cidr is None:
        issues.append(
            Issue(
                path=P + "network.gpuSubnetCidr",
                missing=True,
                message="required unless network.existingVpcId is set: a CIDR inside vpcCidr for "
                "the GPU nodes' subnet in availabilityZone",
            )
        )
    if net.public_subnet_cidrs and len(net.public_subnet_cidrs) != azs:
        issues.append(
            Issue(
                path=P + "network.publicSubnetCidrs",
                value=net.public_subnet_cidrs,
                message=f"need none or one public subnet per availability zone ({azs})",
            )
        )
    if net.use_nat_gateway and not net.public_subnet_cidrs:
        given = "true" if net.nat_gateway else "true by default (a VPC the stack creates)"
        issues.append(
            Issue(
                path=P + "network.natGateway",
                missing=True,  # the message says both values: the default is not a value the user wrote
                message=f"is {given} but network.publicSubnetCidrs is empty: a NAT gateway needs public "
                f"subnets; set network.publicSubnetCidrs (one CIDR per availability zone, {azs}) or "
                "network.natGateway: false",
            )
        )
    return issues


def _subnets_inside_and_disjoint(
    subnets: list[tuple[str, ipaddress.IPv4Network]], vpc: ipaddress.IPv4Network | None
) -> list[Issue]:
    """Every subnet inside the VPC's CIDR (when that is valid), and no two overlapping."""
    issues: list[Issue] = []
    if vpc:
        for path, subnet in subnets:
            if not subnet.subnet_of(vpc):
                issues.append(Issue(path=path, value=str(subnet), message=f"subnet is outside the VPC CIDR {vpc}"))
    for i, (pa, a) in enumerate(subnets):
        for pb, b in subnets[i + 1 :]:
            if a.overlaps(b):
                issues.append(
                    Issue(path=pb, value=str(b), message=f"subnet overlaps {pa} ({a}); subnets must not overlap")
                )
    return issues


def _existing_vpc_rules(c: StackConfig) -> list[Issue]:
    """Bring your own VPC: subnets are named by id; routing, egress and endpoints are the VPC owner's."""
    net, issues = c.network, []
    for key, value in (
        ("privateSubnetCidrs", net.private_subnet_cidrs),
        ("publicSubnetCidrs", net.public_subnet_cidrs),
        ("gpuSubnetCidr", net.gpu_subnet_cidr),
    ):
        if value:
            issues.append(
                Issue(
                    path=f"{P}network.{key}",
                    value=value,
                    message="ambiguous with network.existingVpcId: the stack creates no subnets in an "
                    "existing VPC; remove it and name the subnets in existingPrivateSubnetIds / "
                    "existingGpuSubnetId",
                )
            )
    ids, azs = net.existing_private_subnet_ids, net.availability_zones
    if len(ids) != len(azs):
        issues.append(
            Issue(
                path=P + "network.existingPrivateSubnetIds",
                value=ids,
                message=f"need one subnet id (subnet-...) per availability zone, in the same order ({', '.join(azs)})",
            )
        )
    elif len(set(ids)) != len(ids):
        issues.append(
            Issue(
                path=P + "network.existingPrivateSubnetIds",
                value=ids,
                message="subnet ids must be distinct: a subnet lies in one availability zone",
            )
        )
    if net.existing_gpu_subnet_id is None:
        issues.append(
            Issue(
                path=P + "network.existingGpuSubnetId",
                missing=True,
                message=f"required with network.existingVpcId: the id (subnet-...) of the GPU nodes' "
                f"subnet in availabilityZone {c.availability_zone}",
            )
        )
    if net.nat_gateway:  # only an explicit true: the default is off in an existing VPC
        issues.append(
            Issue(
                path=P + "network.natGateway",
                value=True,
                message="must be false with network.existingVpcId: the VPC owner provides egress "
                "(NAT, endpoints) in an existing VPC; set natGateway: false",
            )
        )
    return issues


def _zones_and_network(c: StackConfig) -> list[Issue]:
    """availabilityZone and every network.availabilityZones entry lie in region (and are distinct).
    vpcCidr is a valid IPv4 CIDR. A created VPC (no existingVpcId) needs one privateSubnetCidrs entry
    per availability zone and a gpuSubnetCidr, all valid, inside vpcCidr and not overlapping, and
    no existing*SubnetId keys; publicSubnetCidrs is empty or one per availability zone, and a NAT
    gateway (natGateway, on by default in a created VPC) needs public subnets (publicSubnetCidrs).
    An existing VPC (existingVpcId) needs one existingPrivateSubnetIds
    entry per availability zone (distinct), an existingGpuSubnetId, no *SubnetCidrs keys, and
    natGateway not true (the VPC owner provides egress)."""
    issues: list[Issue] = []
    region_azs = REGION_AZS.get(c.region)
    valid_azs = [c.region + s for s in region_azs] if region_azs else None

    def check_az(path: str, az: str, local_zones: tuple[str, ...] = ()) -> None:
        if az in local_zones:
            return
        if not az.startswith(c.region) or (valid_azs is not None and az not in valid_azs):
            hint = ", ".join([*valid_azs, *local_zones] if valid_azs else [f"{c.region}<letter>", *local_zones])
            issues.append(
                Issue(path=path, value=az, message=f"availability zone is not in region {c.region}; valid: {hint}")
            )

    # Only the GPU nodes may sit in a Local Zone (where UltraServers are sold); the private subnets
    # hold the EKS control plane's interfaces, which need the region's own AZs.
    check_az(P + "availabilityZone", c.availability_zone, LOCAL_ZONES.get(c.region, ()))
    for i, az in enumerate(c.network.availability_zones):
        check_az(f"{P}network.availabilityZones[{i}]", az)
    if len(set(c.network.availability_zones)) != len(c.network.availability_zones):
        issues.append(
            Issue(
                path=P + "network.availabilityZones",
                value=c.network.availability_zones,
                message="availability zones must be distinct",
            )
        )
    vpc = _nets([(P + "network.vpcCidr", c.network.vpc_cidr)], issues)
    if c.network.existing_vpc_id:
        issues += _existing_vpc_rules(c)
    else:
        issues += _created_vpc_rules(c, vpc[0][1] if vpc else None)
    return issues


def _cluster_access(c: StackConfig) -> list[Issue]:
    """cluster.publicAccessCidrs are valid CIDRs, and a public endpoint lists at least one;
    at least one of endpointPrivateAccess / endpointPublicAccess is true."""
    issues: list[Issue] = []
    for i, cidr in enumerate(c.cluster.public_access_cidrs):
        _nets([(f"{P}cluster.publicAccessCidrs[{i}]", cidr)], issues)
    if c.cluster.endpoint_public_access and not c.cluster.public_access_cidrs:
        issues.append(
            Issue(
                path=P + "cluster.publicAccessCidrs",
                value=[],
                message="a public endpoint needs allowed CIDRs (an empty list means 0.0.0.0/0)",
            )
        )
    if not c.cluster.endpoint_private_access and not c.cluster.endpoint_public_access:
        issues.append(
            Issue(
                path=P + "cluster.endpointPrivateAccess",
                value=False,
                message="at least one of endpointPrivateAccess / endpointPublicAccess must be true",
            )
        )
    return issues


def _node_groups(c: StackConfig) -> list[Issue]:
    """Accelerator node group names are unique; every group pins the same amiReleaseVersion, of
    the cluster's Kubernetes version; requireEfa needs an instance type with EFA; capacity types
    other than on-demand need a reservationId and on-demand has none; a reservation's AZ is
    availabilityZone; a capacity-block group has no placement group and names its block's end
    (endsAt), which no other capacity type has. An instance type sold only in
    UltraServers (p6e-gb200) names its ultraServer; a group with an ultraServer is exactly one
    UltraServer of that instance type (nodes = its instances), bought as a Capacity Block."""
    issues: list[Issue] = []
    names = [g.name for g in c.accelerator_node_groups]
    amis = {g.ami_release_version for g in c.accelerator_node_groups}
    for i, g in enumerate(c.accelerator_node_groups):
        gp = f"{P}acceleratorNodeGroups[{i}]"
        if names.count(g.name) > 1:
            issues.append(Issue(path=gp + ".name", value=g.name, message="node group names must be unique"))
        if not g.ami_release_version.startswith(c.cluster.kubernetes_version + "."):
            issues.append(
                Issue(
                    path=gp + ".amiReleaseVersion",
                    value=g.ami_release_version,
                    message=f"AMI release must match the cluster's Kubernetes {c.cluster.kubernetes_version} "
                    f"(e.g. {c.cluster.kubernetes_version}.0-20251120)",
                )
            )
        if len(amis) > 1:
            issues.append(
                Issue(
                    path=gp + ".amiReleaseVersion",
                    value=g.ami_release_version,
                    message=f"all accelerator node groups must pin the same AMI release; found {sorted(amis)}",
                )
            )
        if g.require_efa and CATALOG[g.instance_type].efa_interfaces == 0:
            issues.append(Issue(path=gp + ".instanceType", value=g.instance_type, message="instance type has no EFA"))
        issues += _capacity(g, gp, c.availability_zone)
        issues += _ultra_server(g, gp)
    return issues


def _capacity(g, gp: str, availability_zone: str) -> list[Issue]:
    """A group's capacity: a reservation id exactly when not on-demand, the reservation in the GPU
    subnet's AZ, and a Capacity Block's end time (endsAt) and no placement group."""
    cap, issues = g.capacity, []
    if cap.type != "on-demand" and not cap.reservation_id:
        issues.append(
            Issue(
                path=gp + ".capacity.reservationId",
                value=None,
                message=f"capacity type {cap.type} needs a reservation id (cr-...)",
            )
        )
    if cap.type == "on-demand" and cap.reservation_id:
        issues.append(
            Issue(
                path=gp + ".capacity.type",
                value=cap.type,
                message="a reservation id is set: use capacity-reservation or capacity-block",
            )
        )
    if cap.availability_zone and cap.availability_zone != availability_zone:
        issues.append(
            Issue(
                path=gp + ".capacity.availabilityZone",
                value=cap.availability_zone,
                message=f"the reservation's AZ must be the GPU subnet's AZ {availability_zone}",
            )
        )
    if cap.type == "capacity-block" and cap.ends_at is None:
        issues.append(
            Issue(
                path=gp + ".capacity.endsAt",
                missing=True,
                message="a Capacity Block needs its end time (EC2's EndDate, e.g. 2026-03-14T11:30:00Z): "
                "the node group is scaled to 0 forty minutes before it",
            )
        )
    if cap.type != "capacity-block" and cap.ends_at is not None:
        issues.append(
            Issue(
                path=gp + ".capacity.endsAt",
                value=cap.ends_at.isoformat(),
                message=f"endsAt is a Capacity Block's end; capacity type {cap.type} has none: remove it",
            )
        )
    if cap.type == "capacity-block" and g.placement_group:
        issues.append(
            Issue(
                path=gp + ".placementGroup",
                value=True,
                message="Capacity Blocks are already co-located and conflict with a placement group; set false",
            )
        )
    return issues


def _ultra_server(g, gp: str) -> list[Issue]:
    sizes = [u.name for u in ULTRASERVERS.values() if u.instance_type == g.instance_type]
    if g.ultra_server is None:
        return (
            [
                Issue(
                    path=gp + ".ultraServer",
                    missing=True,
                    message=f"{g.instance_type} is sold only as UltraServers: set ultraServer to one of "
                    f"{', '.join(sizes)} (one node group per UltraServer)",
                )
            ]
            if ultraserver_only(g.instance_type)
            else []
        )
    u, issues = ULTRASERVERS[g.ultra_server], []
    if u.instance_type != g.instance_type:
        issues.append(
            Issue(
                path=gp + ".ultraServer",
                value=g.ultra_server,
                message=f"{g.ultra_server} is made of {u.instance_type}, not {g.instance_type}",
            )
        )
    elif g.nodes != u.instances:
        issues.append(
            Issue(
                path=gp + ".nodes",
                value=g.nodes,
                message=f"one node group is one {g.ultra_server}: nodes must be {u.instances} (add a node "
                f"group per further UltraServer, each with its own Capacity Block)",
            )
        )
    if g.capacity.type != "capacity-block":
        issues.append(
            Issue(
                path=gp + ".capacity.type",
                value=g.capacity.type,
                message="UltraServers are sold as Capacity Blocks: use capacity-block with the block's "
                "reservationId (cr-...)",
            )
        )
    return issues


def _system_node_group(c: StackConfig) -> list[Issue]:
    """systemNodeGroup: minSize <= desiredSize <= maxSize."""
    issues: list[Issue] = []
    sng = c.system_node_group
    if not sng.min_size <= sng.desired_size <= sng.max_size:
        issues.append(
            Issue(
                path=P + "systemNodeGroup.desiredSize",
                value=sng.desired_size,
                message=f"need minSize <= desiredSize <= maxSize ({sng.min_size}..{sng.max_size})",
            )
        )
    return issues


def _storage(c: StackConfig) -> list[Issue]:
    """storage.lifecycle.checkpointExpireDays is greater than checkpointTransitionDays;
    existingBucket needs a bucketName."""
    issues: list[Issue] = []
    lc = c.storage.lifecycle
    if lc.checkpoint_expire_days <= lc.checkpoint_transition_days:
        issues.append(
            Issue(
                path=P + "storage.lifecycle.checkpointExpireDays",
                value=lc.checkpoint_expire_days,
                message=f"must be greater than checkpointTransitionDays ({lc.checkpoint_transition_days})",
            )
        )
    if c.storage.existing_bucket and not c.storage.bucket_name:
        issues.append(Issue(path=P + "storage.bucketName", value=None, message="existingBucket needs a bucketName"))
    return issues


def _cluster_version(c: StackConfig) -> list[Issue]:
    """cluster.kubernetesVersion has a row of pinned EKS add-on versions in the catalog."""
    issues: list[Issue] = []
    if c.cluster.kubernetes_version not in EKS_ADDON_VERSIONS:
        issues.append(
            Issue(
                path=P + "cluster.kubernetesVersion",
                value=c.cluster.kubernetes_version,
                message=f"no pinned EKS add-on versions for it; supported: {', '.join(EKS_ADDON_VERSIONS)}",
            )
        )
    return issues


def _layout(c: StackConfig) -> list[Issue]:
    """The parallel layout passes the layout validator (below) with world size = the sum of nodes x
    accelerators per node over the training node groups (role: training; serving's are outside the
    world), and tp at most the GPUs of one NVLink domain (a node, or the group's UltraServer)."""
    if not c.training_node_groups:
        roles = [g.role for g in c.accelerator_node_groups]
        return [
            Issue(
                path="supernode:acceleratorNodeGroups[].role",
                value=roles,
                message="no group has role: training, so the training job has no world; give at least one group "
                "role: training (serving's groups are outside the world)",
            )
        ]
    max_tp = min(g.nvlink_domain for g in c.training_node_groups)
    return layout_rules(
        c.model,
        c.parallel,
        c.training,
        c.accelerators,
        max_tp,
        world_source=" (sum of nodes x accelerators per node of the role: training groups)",
    )


def _elastic(c: StackConfig) -> list[Issue]:
    """training.minNodes is at most the training nodes: an elastic job shrinks, never grows past its plan."""
    m = c.training.min_nodes
    if m is None or m <= c.nodes:
        return []
    return [
        Issue(
            path=P + "training.minNodes",
            value=m,
            message=f"must be at most the training nodes ({c.nodes}, the role: training groups' nodes): the "
            "elastic job runs on minNodes to that many nodes",
        )
    ]


def _spares(c: StackConfig) -> list[Issue]:
    """Spare nodes stand by for the training job only: a serving group scales by replicas, and an
    UltraServer group is exactly its UltraServer's instances (a spare would be outside its NVLink domain)."""
    issues = []
    for i, g in enumerate(c.accelerator_node_groups):
        if not g.spares:
            continue
        path = f"{P}acceleratorNodeGroups[{i}].spares"
        if g.role == "serving":
            issues.append(
                Issue(
                    path=path,
                    value=g.spares,
                    message="spare nodes stand by for the training job: only a role: training group has them; "
                    "serving scales by inference.replicasMin/replicasMax; remove it",
                )
            )
        elif g.ultra_server:
            issues.append(
                Issue(
                    path=path,
                    value=g.spares,
                    message=f"a group with ultraServer is exactly one {g.ultra_server}: a spare instance would be "
                    "outside its NVLink domain; remove it (spare capacity there is a whole UltraServer)",
                )
            )
    return issues


def _stall(c: StackConfig) -> list[Issue]:
    """training.stallRestartS is above collectiveTimeoutS: a hang inside a collective fails with the
    collective's own error first; the heartbeat catches the hangs no collective times out."""
    t = c.training
    if t.stall_restart_s > t.collective_timeout_s:
        return []
    return [
        Issue(
            path=P + "training.stallRestartS",
            value=t.stall_restart_s,
            message=f"must be above training.collectiveTimeoutS ({t.collective_timeout_s}): a hung collective "
            "fails with its own error first, the stall restart catches what no collective times out",
        )
    ]


def _local(c: StackConfig) -> list[Issue]:
    """The stack with the local overrides applied is valid, and its layout passes the layout
    validator with world size = local.nproc (the CPU processes of `supernode train --local`)."""
    try:
        local = c.local_config()
    except ValidationError as e:
        return issues_from_validation(e, P + "local.", c.model_dump(by_alias=True, mode="json"))
    return layout_rules(
        local.model,
        local.parallel,
        local.training,
        c.local.nproc,
        c.local.nproc,
        prefix=P + "local.",
        world_source=" (local.nproc)",
    )


def _teams(c: StackConfig) -> list[Issue]:
    """Teams share one training pool (their quotas are in its devices): names and IAM roles unique, each
    team's namespace none of the stack's own, quotas and limits in whole nodes (a job's pods are whole
    nodes), and a team lends at most its quota. That the quotas add up to training's share is the
    accelerators-pools-add-up policy's (a job's plan runs on part of the share, and must still validate)."""
    if not c.teams:
        return []
    issues: list[Issue] = []
    pools = {CATALOG[g.instance_type].accelerator: CATALOG[g.instance_type].chips for g in c.training_node_groups}
    if len(pools) > 1:
        issues.append(
            Issue(
                path=P + "teams",
                value=[t.name for t in c.teams],
                message=f"teams' quotas are in the devices of one training pool; the training groups span "
                f"{len(pools)} accelerators ({', '.join(pools)}): give them one accelerator, or no teams",
            )
        )
    per_node = min(pools.values(), default=1)
    names = [t.name for t in c.teams]
    principals = [t.principal for t in c.teams]
    own = {c.workload.namespace} | ({c.inference.namespace} if c.inference else set())
    for i, t in enumerate(c.teams):
        tp = f"{P}teams[{i}]"
        if names.count(t.name) > 1:
            issues.append(Issue(path=tp + ".name", value=t.name, message="team names must be unique"))
        if team_namespace(t.name) in own:
            issues.append(
                Issue(
                    path=tp + ".name",
                    value=t.name,
                    message=f"its namespace {team_namespace(t.name)} is the stack's own (workload.namespace or "
                    "inference.namespace); rename the team",
                )
            )
        if t.name == "serving" or t.name.endswith("-serving"):  # gpu-<acc>-<team> would read as serving's queue
            issues.append(
                Issue(
                    path=tp + ".name",
                    value=t.name,
                    message="its ClusterQueue gpu-<accelerator>-<name> would end like serving's queue "
                    "(gpu-<accelerator>-serving); rename the team",
                )
            )
        if principals.count(t.principal) > 1:
            issues.append(
                Issue(
                    path=tp + ".principal",
                    value=t.principal,
                    message="each team has its own IAM role: one role maps to one Kubernetes group",
                )
            )
        if t.lending_limit > t.nominal_quota:
            issues.append(
                Issue(
                    path=tp + ".lendingLimit",
                    value=t.lending_limit,
                    message=f"must be at most the team's nominalQuota ({t.nominal_quota}): a team lends only its own",
                )
            )
        for key, value in (
            ("nominalQuota", t.nominal_quota),
            ("borrowingLimit", t.borrowing_limit),
            ("lendingLimit", t.lending_limit),
        ):
            if value % per_node:
                issues.append(
                    Issue(
                        path=f"{tp}.{key}",
                        value=value,
                        message=f"must be whole nodes: a multiple of a training node's {per_node} devices",
                    )
                )
    return issues


def _management(c: StackConfig) -> list[Issue]:
    """The management page is deployed only with ranges to admit (never an empty list, which an open
    listener would read as everyone) and teams to map people to (its authorisation is theirs)."""
    if c.management.ui is None:
        return []
    issues: list[Issue] = []
    if not c.management.allowed_cidrs:
        issues.append(
            Issue(
                path=P + "management.allowedCidrs",
                value=[],
                message="management.ui needs the networks its load balancer admits (e.g. the VPN's 10.8.0.0/16)",
            )
        )
    if not c.teams:
        issues.append(
            Issue(
                path=P + "teams",
                value=[],
                message="management.ui maps a person to a team by the team's group: give supernode:teams",
            )
        )
    return issues


# Each rule with the top-level sections it reads: when some sections fail the schema, the rules
# over the valid ones still run, so a stack file's problems are reported in one round.
RULES = (
    (("region", "availability_zone", "network"), _zones_and_network),
    (("cluster",), _cluster_access),
    (("cluster", "accelerator_node_groups", "availability_zone"), _node_groups),
    (("system_node_group",), _system_node_group),
    (("storage",), _storage),
    (("cluster",), _cluster_version),
    (("model", "parallel", "training", "accelerator_node_groups"), _layout),
    (("training", "accelerator_node_groups"), _elastic),
    (("training",), _stall),
    (("accelerator_node_groups",), _spares),
    (("teams", "accelerator_node_groups", "workload", "inference"), _teams),
    (("management", "teams"), _management),
    (tuple(StackConfig.model_fields), _local),
)


def rules(c: StackConfig, valid: set[str] | None = None) -> list[Issue]:
    """Every cross-field problem; with `valid` (the sections that passed the schema) only the
    rules whose sections are all valid run."""
    return [issue for sections, rule in RULES if valid is None or valid.issuperset(sections) for issue in rule(c)]
