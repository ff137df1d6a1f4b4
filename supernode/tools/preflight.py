"""Preflight: what must be true in the AWS account before `pulumi up`, checked from the StackConfig.

Instance types offered in the GPU AZ and matching the catalog the plan was sized with; the targeted
capacity reservations / Capacity Blocks; the On-Demand vCPU quota; the existing VPC, subnets,
bucket and KMS key the config names. Checks that do not apply to a stack (nothing reserved, no
existing VPC...) are not listed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

from botocore.exceptions import ClientError

from ..core.catalog import CATALOG, LOCAL_ZONES, zone_group
from ..core.config import AcceleratorNodeGroup, StackConfig
from .awscheck import Aws, Check, Step, error_code, failed, passed, run_checks, warned

CATALOG_FIX = (
    "correct supernode/catalog.py (the plan was sized with the catalog's figures), then re-run `supernode plan`"
)
# EC2 On-Demand vCPU quotas are per instance-family group; every catalog type is a P instance or a
# Trainium one (tests/tools/test_preflight.py holds the catalog to that).
P_QUOTA_CODE, P_QUOTA_NAME = "L-417A185B", "Running On-Demand P instances"
TRN_QUOTA_CODE, TRN_QUOTA_NAME = "L-2C3B7624", "Running On-Demand Trn instances"


def quota_of(instance_type: str) -> tuple[str, str]:
    """The On-Demand vCPU quota (code, name) an instance type counts against."""
    return (TRN_QUOTA_CODE, TRN_QUOTA_NAME) if instance_type.startswith("trn") else (P_QUOTA_CODE, P_QUOTA_NAME)


def check_offering(aws: Aws, instance_type: str, az: str) -> Check:
    name = f"offering {instance_type}"
    pages = (
        aws.client("ec2")
        .get_paginator("describe_instance_type_offerings")
        .paginate(LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [instance_type]}])
    )
    azs = sorted({o["Location"] for page in pages for o in page["InstanceTypeOfferings"]})
    if az in azs:
        return passed(name, f"EC2 offers {instance_type} in {az}")
    where = (
        f"choose an AZ that offers it: {', '.join(azs)}"
        if azs
        else f"no AZ of {aws.region} offers it: choose another region"
    )
    if az in LOCAL_ZONES.get(aws.region, ()):  # a Local Zone's offerings are listed once it is opted in
        where = f"{az} is a Local Zone: if its group is not opted in, `{_opt_in(az)}`; else {where}"
    return failed(name, f"EC2 does not offer {instance_type} in {az}", where + " (availabilityZone and the GPU subnet)")


# A Neuron type's device figures, as EC2's NeuronInfo states them (catalog_figures gives the same keys).
NEURON_DEVICE_FIGURES = ("Neuron devices", "accelerator", "device memory MiB", "cores per device")


def ec2_figures(it: dict) -> dict[str, object]:
    """The figures of one DescribeInstanceTypes entry that the catalog also holds (a Neuron type's
    devices from NeuronInfo, a GPU type's from GpuInfo)."""
    net = it.get("NetworkInfo", {})
    card0 = next((c for c in net.get("NetworkCards", []) if c.get("NetworkCardIndex") == 0), {})
    if "NeuronInfo" in it or it.get("InstanceType", "").startswith("trn"):
        devices = it.get("NeuronInfo", {}).get("NeuronDevices", [])
        accelerators: dict[str, object] = {
            "Neuron devices": sum(d.get("Count", 0) for d in devices),
            "accelerator": ",".join(sorted({d.get("Name", "") for d in devices})),
            "device memory MiB": min((d.get("MemoryInfo", {}).get("SizeInMiB", 0) for d in devices), default=0),
            "cores per device": min((d.get("CoreInfo", {}).get("Count", 0) for d in devices), default=0),
        }
    else:
        gpus = it.get("GpuInfo", {}).get("Gpus", [])
        accelerators = {
            "GPUs": sum(g.get("Count", 0) for g in gpus),
            "accelerator": ",".join(sorted({g.get("Name", "") for g in gpus})),
            "GPU memory MiB": min((g.get("MemoryInfo", {}).get("SizeInMiB", 0) for g in gpus), default=0),
        }
    return {
        **accelerators,
        "max EFA interfaces": net.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0),
        "network cards": net.get("MaximumNetworkCards", 0),
        "card 0 EFA": bool({"efa", "efa-only"} & set(card0.get("InterfaceTypes", []))),
        "vCPUs": it.get("VCpuInfo", {}).get("DefaultVCpus", 0),
        "architecture": ",".join(it.get("ProcessorInfo", {}).get("SupportedArchitectures", [])),
    }


def catalog_figures(instance_type: str) -> dict[str, object]:
    """The same figures as the catalog states them (what the plan and the launch templates use)."""
    hw = CATALOG[instance_type]
    if hw.vendor == "neuron":  # the catalog counts logical cores (ranks); EC2 counts chips and physical cores
        accelerators: dict[str, object] = {
            "Neuron devices": hw.chips,
            "accelerator": hw.accelerator,
            "device memory MiB": hw.hbm_mib * hw.ranks_per_chip,
            "cores per device": hw.neuron_cores_per_chip,
        }
    else:
        accelerators = {"GPUs": hw.accelerators, "accelerator": hw.accelerator, "GPU memory MiB": hw.hbm_mib}
    return {
        **accelerators,
        "max EFA interfaces": hw.efa_interfaces,
        "network cards": hw.network_cards,
        "card 0 EFA": hw.card0_efa,
        "vCPUs": hw.vcpus,
        "architecture": hw.arch,
    }


def check_instance_type(aws: Aws, instance_type: str) -> Check:
    name = f"instance type {instance_type}"
    try:
        it = aws.client("ec2").describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"][0]
    except ClientError as e:
        if error_code(e) != "InvalidInstanceType":
            raise
        # p6e-gb200 is sold only inside UltraServers: not every endpoint (nor moto) describes it.
        return warned(
            name,
            f"EC2 in {aws.region} does not describe {instance_type}: the catalog's figures could not be compared",
            f"compare supernode/core/catalog.py with `aws ec2 describe-instance-types "
            f"--instance-types {instance_type}` where it is sold",
        )
    reported, expected = ec2_figures(it), catalog_figures(instance_type)
    neuron = CATALOG[instance_type].vendor == "neuron"
    if neuron and not it.get("NeuronInfo"):
        # EC2 (and moto's snapshot of it) does not describe every Trainium type's devices (trn2u).
        for figures in (reported, expected):
            for key in NEURON_DEVICE_FIGURES:
                figures.pop(key, None)
    wrong = [f"{k}: catalog {expected[k]}, EC2 {reported[k]}" for k in expected if expected[k] != reported[k]]
    if wrong and neuron and wrong[0].startswith("device memory MiB") and len(wrong) == 1:
        # EC2's NeuronInfo has reported 524288 MiB per Trainium2 device, against the 96 GiB of AWS's
        # Neuron documentation (trainium2 architecture) the plan is sized on: say so, do not fail.
        return warned(
            name,
            f"EC2 reports {reported['device memory MiB']} MiB per {expected['accelerator']} device, the catalog "
            f"{expected['device memory MiB']} (AWS Neuron documentation); every other figure matches",
            "check `aws ec2 describe-instance-types` against the Neuron architecture page; the plan uses the catalog",
        )
    if wrong:
        return failed(name, "catalog differs from EC2: " + "; ".join(wrong), CATALOG_FIX)
    if neuron and not it.get("NeuronInfo"):
        return warned(
            name,
            f"EC2 does not describe {instance_type}'s Neuron devices; the rest matches: "
            + ", ".join(f"{k} {v}" for k, v in reported.items()),
            "compare the catalog's Trainium2 figures with the Neuron documentation (docs/hardware.md)",
        )
    return passed(name, ", ".join(f"{k} {v}" for k, v in reported.items()) + " (as in the catalog)")


def check_reservation(aws: Aws, reservation_id: str, groups: list[AcceleratorNodeGroup], az: str) -> Check:
    name = f"capacity {reservation_id}"
    need = sum(g.instances for g in groups)  # spares run in the reservation too
    users = ", ".join(g.name for g in groups)
    kind = groups[0].capacity.type
    try:
        found = aws.client("ec2").describe_capacity_reservations(CapacityReservationIds=[reservation_id])
    except ClientError as e:
        if not error_code(e).startswith("InvalidCapacityReservationId"):
            raise
        return failed(
            name,
            f"{kind} {reservation_id} not found in {aws.region} ({error_code(e)})",
            f"check capacity.reservationId of {users} (aws ec2 describe-capacity-reservations)",
        )
    r = found["CapacityReservations"][0]
    problems = []
    rtype = r.get("ReservationType", "default")
    if (kind == "capacity-block") != (rtype == "capacity-block"):
        problems.append(f"config says {kind}, EC2 reports reservation type {rtype}")
    if r.get("AvailabilityZone") != az:
        problems.append(f"in {r.get('AvailabilityZone')}, not the GPU AZ {az}")
    types = sorted({g.instance_type for g in groups})
    if types != [r.get("InstanceType")]:
        problems.append(f"reserves {r.get('InstanceType')}, node groups use {', '.join(types)}")
    total, available = r.get("TotalInstanceCount", 0), r.get("AvailableInstanceCount", 0)
    if available < need:
        problems.append(f"{available} of {total} instances available, {users} need {need}")
    state = r.get("State")
    starts, ends = r.get("StartDate"), r.get("EndDate")
    if state != "active" and not (state == "scheduled" and rtype == "capacity-block"):
        problems.append(f"state {state}, not active")
    if kind == "capacity-block" and rtype == "capacity-block":
        problems += block_end_problems(groups, ends)
    if problems:
        return failed(
            name, "; ".join(problems), f"fix capacity.* of {users} or the reservation, or use capacity type on-demand"
        )
    detail = f"{rtype} {r.get('InstanceType')} in {az}: {available}/{total} available, {need} needed ({users})"
    if rtype == "capacity-block":
        # docs/hardware.md: block instances terminate from 30 min before the end; node groups go to 0 by 40 min before.
        detail += (
            f"; window {starts} to {ends} (instances stop from 30 min before the end: the node groups scale "
            f"to 0 at {groups[0].capacity.scale_to_zero_at})"
        )
    if state == "scheduled":
        return warned(
            name,
            f"{detail}; Capacity Block is scheduled, starts {starts}",
            "deploy the node groups once the block is active (pulumi up before then leaves nodes pending)",
        )
    return passed(name, f"{detail}; {state}")


def check_ultraserver_block(aws: Aws, reservation_id: str, group: AcceleratorNodeGroup) -> Check:
    """An UltraServer group's reservation is a Capacity Block of that UltraServer: EC2 gives the
    reservation's topology a CapacityBlockId only for UltraServer capacity ("identifies instances within
    the UltraServer domain", EC2 API reference, CapacityReservationTopology), DescribeCapacityBlocks
    names the block's UltraserverType, and DescribeCapacityBlockStatus its accelerator interconnect
    (ok | impaired | insufficient-data). Any other reservation would place the group's instances apart,
    outside one scale-up domain, and the plan's domain figures would not hold."""
    name = f"ultraserver capacity {group.name}"
    link, users = CATALOG[group.instance_type].link_name, f"capacity.reservationId of {group.name}"
    ec2 = aws.client("ec2")
    topology = ec2.describe_capacity_reservation_topology(CapacityReservationIds=[reservation_id])
    block = next((t.get("CapacityBlockId") for t in topology["CapacityReservations"]), None)
    if not block:
        return failed(
            name,
            f"{reservation_id} is in no UltraServer Capacity Block (EC2's topology gives it no capacityBlockId): "
            f"the {group.instance_type} instances of {group.name} would not share one {link} domain",
            f"buy a {group.ultra_server} UltraServer Capacity Block and set {users} to its reservation",
        )
    [cb] = ec2.describe_capacity_blocks(CapacityBlockIds=[block])["CapacityBlocks"]
    statuses = ec2.describe_capacity_block_status(CapacityBlockIds=[block])["CapacityBlockStatuses"]
    interconnect = statuses[0].get("InterconnectStatus") if statuses else "insufficient-data"
    problems = []
    if cb.get("UltraserverType") != group.ultra_server:
        problems.append(
            f"Capacity Block {block} holds UltraServer type {cb.get('UltraserverType')}, not {group.ultra_server}"
        )
    if reservation_id not in cb.get("CapacityReservationIds", []):
        problems.append(f"Capacity Block {block} does not list {reservation_id} among its reservations")
    if interconnect == "impaired":
        problems.append(f"EC2 reports the {link} interconnect of Capacity Block {block} impaired")
    if problems:
        return failed(name, "; ".join(problems), f"check {users}, or ask AWS support about the block")
    detail = f"{reservation_id} is in {group.ultra_server} Capacity Block {block}, {link} interconnect {interconnect}"
    if interconnect != "ok":
        return warned(name, detail, f"aws ec2 describe-capacity-block-status --capacity-block-ids {block} once it runs")
    return passed(name, detail)


def block_end_problems(groups: list[AcceleratorNodeGroup], ends: datetime | None) -> list[str]:
    """The groups' capacity.endsAt against EC2's EndDate of their Capacity Block (the node groups'
    scale to 0 is timed from endsAt), and that scale-down still ahead (AWS refuses a scheduled
    action whose start time is past)."""
    if ends is None:
        return ["EC2 reports no EndDate for the Capacity Block"]
    problems = [
        f"{g.name}: capacity.endsAt {g.capacity.ends_at} but EC2's EndDate is {ends}"
        for g in groups
        if g.capacity.ends_at != ends
    ]
    if not problems and groups[0].capacity.scale_to_zero_at <= datetime.now(UTC):
        problems.append(
            f"the block ends {ends}: its node groups' scale to 0 at "
            f"{groups[0].capacity.scale_to_zero_at} is past (buy a new block)"
        )
    return problems


def _opt_in(zone: str, group: str | None = None) -> str:
    return f"aws ec2 modify-availability-zone-group --group-name {group or zone_group(zone)} --opt-in-status opted-in"


def check_zone_opt_in(aws: Aws, zone: str) -> Check:
    """A Local Zone (where UltraServers are sold) is usable only once its zone group is opted in."""
    name = f"zone {zone}"
    zones = aws.client("ec2").describe_availability_zones(AllAvailabilityZones=True, ZoneNames=[zone])[
        "AvailabilityZones"
    ]
    if not zones:
        return failed(
            name,
            f"EC2 does not list {zone}, a Local Zone of {aws.region}: an account sees a Local Zone only once "
            "its zone group is opted in",
            f"{_opt_in(zone)}, or set availabilityZone to a zone of {aws.region} that your account lists",
        )
    z = zones[0]
    group = z.get("GroupName") or zone_group(zone)
    if z.get("OptInStatus") == "not-opted-in":
        return failed(name, f"{zone} ({z.get('ZoneType', 'zone')}) is not opted in", _opt_in(zone, group))
    return passed(name, f"{zone} ({z.get('ZoneType', 'zone')}, group {group}): {z.get('OptInStatus', 'opted-in')}")


def check_quota(aws: Aws, code: str, quota_name: str, vcpus: int, users: str) -> Check:
    name = f"quota {code}"
    quota = aws.client("service-quotas").get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
    value = quota.get("Value", 0)
    detail = f"{quota_name}: quota {value:g} vCPUs, {users} need {vcpus} (instances already running not subtracted)"
    if value < vcpus:
        return failed(
            name,
            detail,
            f"request an increase: aws service-quotas request-service-quota-increase "
            f"--service-code ec2 --quota-code {code} --desired-value {vcpus}",
        )
    return passed(name, detail)


def check_vpc(aws: Aws, vpc_id: str, cidr: str) -> Check:
    name = f"vpc {vpc_id}"
    vpcs = aws.client("ec2").describe_vpcs(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])["Vpcs"]
    if not vpcs:
        return failed(name, f"VPC {vpc_id} not found in {aws.region}", "check network.existingVpcId")
    v = vpcs[0]
    cidrs = sorted({v["CidrBlock"]} | {a["CidrBlock"] for a in v.get("CidrBlockAssociationSet", [])})
    if cidr not in cidrs:
        return failed(
            name,
            f"VPC CIDRs {', '.join(cidrs)} do not include network.vpcCidr {cidr}",
            "set network.vpcCidr to the VPC's CIDR",
        )
    if v.get("State") != "available":
        return failed(name, f"VPC state {v.get('State')}", "wait until the VPC is available")
    return passed(name, f"exists, {v.get('State')}, CIDR {cidr}")


@dataclass(frozen=True)
class WantedSubnet:
    key: str  # the config key that names it, e.g. network.existingGpuSubnetId
    subnet_id: str
    az: str  # the AZ it must be in
    az_key: str  # the config key that names that AZ


def wanted_subnets(cfg: StackConfig) -> list[WantedSubnet]:
    """The existing subnets a config names, each with the AZ it must be in."""
    net = cfg.network
    out = [
        WantedSubnet(f"network.existingPrivateSubnetIds[{i}]", s, az, f"network.availabilityZones[{i}]")
        for i, (s, az) in enumerate(zip(net.existing_private_subnet_ids, net.availability_zones))
    ]
    if net.existing_gpu_subnet_id:
        out.append(
            WantedSubnet(
                "network.existingGpuSubnetId",
                net.existing_gpu_subnet_id,
                cfg.availability_zone,
                "the GPU AZ availabilityZone",
            )
        )
    return out


def check_subnets(aws: Aws, wanted: list[WantedSubnet], vpc_id: str) -> Check:
    name = "subnets"
    ids = sorted({w.subnet_id for w in wanted})
    found = aws.client("ec2").describe_subnets(Filters=[{"Name": "subnet-id", "Values": ids}])["Subnets"]
    by_id = {s["SubnetId"]: s for s in found}
    problems = []
    for w in wanted:
        sub = by_id.get(w.subnet_id)
        if sub is None:
            problems.append(f"{w.key} {w.subnet_id} not found")
            continue
        if sub["VpcId"] != vpc_id:
            problems.append(f"{w.key} {w.subnet_id} is in {sub['VpcId']}, not {vpc_id}")
        if sub["AvailabilityZone"] != w.az:
            problems.append(f"{w.key} {w.subnet_id} is in {sub['AvailabilityZone']}, not {w.az_key} {w.az}")
    if problems:
        return failed(
            name,
            "; ".join(problems),
            "check network.existingPrivateSubnetIds (one per network.availabilityZones, same order), "
            "network.existingGpuSubnetId (a subnet in availabilityZone) and network.existingVpcId",
        )
    return passed(name, f"{len(wanted)} exist in {vpc_id}: " + ", ".join(f"{w.subnet_id} ({w.az})" for w in wanted))


def check_bucket(aws: Aws, bucket: str) -> Check:
    name = f"bucket {bucket}"
    s3 = aws.client("s3")
    try:
        head = s3.head_bucket(Bucket=bucket)
    except ClientError as e:
        if error_code(e) not in ("404", "NoSuchBucket"):
            raise
        return failed(
            name,
            f"bucket {bucket} does not exist",
            "create it, or set storage.existingBucket: false to let the stack create it",
        )
    region = head.get("BucketRegion") or head["ResponseMetadata"].get("HTTPHeaders", {}).get("x-amz-bucket-region")
    if region and region != aws.region:
        return failed(
            name,
            f"bucket is in {region}, the stack in {aws.region}",
            "use a bucket in the stack's region (FSx links to S3 in its own region)",
        )
    try:
        rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    except ClientError as e:
        if error_code(e) != "ServerSideEncryptionConfigurationNotFoundError":
            raise
        return failed(
            name,
            "exists but has no default encryption",
            f"aws s3api put-bucket-encryption --bucket {bucket} (SSE-KMS with the stack's key)",
        )
    sse = rules[0]["ApplyServerSideEncryptionByDefault"]
    key = sse.get("KMSMasterKeyID")
    return passed(name, f"exists, encrypted with {sse['SSEAlgorithm']}" + (f" ({key})" if key else ""))


def check_kms_key(aws: Aws, key_arn: str) -> Check:
    name = "kms key"
    region = key_arn.split(":")[3]
    try:
        meta = aws.client("kms", region=region).describe_key(KeyId=key_arn)["KeyMetadata"]
    except ClientError as e:
        if error_code(e) != "NotFoundException":
            raise
        return failed(name, f"{key_arn} not found", "check identity.kmsKeyArn")
    state = meta.get("KeyState")
    if state != "Enabled":
        fix = (
            f"aws kms cancel-key-deletion --key-id {key_arn}, then enable-key"
            if state == "PendingDeletion"
            else f"aws kms enable-key --key-id {key_arn}"
        )
        return failed(name, f"{key_arn} is {state}", fix)
    return passed(name, f"{key_arn} is Enabled")


def preflight_steps(cfg: StackConfig, aws: Aws) -> list[Step]:
    az = cfg.availability_zone
    types = sorted({g.instance_type for g in cfg.accelerator_node_groups})
    steps = [Step(f"zone {az}", partial(check_zone_opt_in, aws, az))] if az in LOCAL_ZONES.get(cfg.region, ()) else []
    steps += [Step(f"offering {t}", partial(check_offering, aws, t, az)) for t in types]
    steps += [Step(f"instance type {t}", partial(check_instance_type, aws, t)) for t in types]

    reserved: dict[str, list[AcceleratorNodeGroup]] = defaultdict(list)
    for g in cfg.accelerator_node_groups:
        if g.capacity.reservation_id:
            reserved[g.capacity.reservation_id].append(g)
    steps += [
        Step(
            f"capacity {rid}",
            partial(check_reservation, aws, rid, groups, az),
            on_unsupported="warn",
            hint=f"aws ec2 describe-capacity-reservations --capacity-reservation-ids {rid}",
        )
        for rid, groups in sorted(reserved.items())
    ]
    # An UltraServer group's reservation must be that UltraServer's Capacity Block (one scale-up domain).
    steps += [
        Step(
            f"ultraserver capacity {g.name}",
            partial(check_ultraserver_block, aws, g.capacity.reservation_id, g),
            on_unsupported="warn",
            hint="aws ec2 describe-capacity-reservation-topology --capacity-reservation-ids "
            f"{g.capacity.reservation_id}",
        )
        for g in cfg.accelerator_node_groups
        if g.ultra_server and g.capacity.reservation_id
    ]

    # Capacity Blocks do not count against the On-Demand quota; on-demand and ODCR instances do.
    counted = [g for g in cfg.accelerator_node_groups if g.capacity.type != "capacity-block"]
    for code, quota_name in sorted({quota_of(g.instance_type) for g in counted}):
        mine = [g for g in counted if quota_of(g.instance_type)[0] == code]
        vcpus = sum(g.instances * CATALOG[g.instance_type].vcpus for g in mine)
        users = ", ".join(g.name for g in mine)
        steps.append(
            Step(
                f"quota {code}",
                partial(check_quota, aws, code, quota_name, vcpus, users),
                on_error="warn",
                hint=f"{quota_name} must cover {vcpus} vCPUs: aws service-quotas "
                f"get-service-quota --service-code ec2 --quota-code {code}",
            )
        )

    net = cfg.network
    if net.existing_vpc_id:
        steps.append(Step(f"vpc {net.existing_vpc_id}", partial(check_vpc, aws, net.existing_vpc_id, net.vpc_cidr)))
        steps.append(Step("subnets", partial(check_subnets, aws, wanted_subnets(cfg), net.existing_vpc_id)))
    if cfg.storage.existing_bucket and cfg.storage.bucket_name:
        steps.append(Step(f"bucket {cfg.storage.bucket_name}", partial(check_bucket, aws, cfg.storage.bucket_name)))
    if cfg.identity.kms_key_arn:
        steps.append(Step("kms key", partial(check_kms_key, aws, cfg.identity.kms_key_arn)))
    return steps


def run_preflight(cfg: StackConfig, aws: Aws | None = None) -> list[Check]:
    return run_checks(preflight_steps(cfg, aws or Aws(cfg.region)))
