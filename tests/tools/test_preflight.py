"""`supernode preflight` against a real moto server (fixture `moto_aws` in conftest.py).

moto lacks DescribeCapacityReservations and the EC2 quota in Service Quotas: with moto alone those
checks must say plainly that they cannot be checked (warn); their pass/fail cases use real AWS-shaped
HTTP answers from the stub in front of moto.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import boto3
import pytest
import yaml

from supernode.cli import main
from supernode.core import catalog
from supernode.core.config import from_mapping, read_stack_file
from supernode.tools.awscheck import Aws, Check
from supernode.tools.preflight import (
    P_QUOTA_CODE,
    check_bucket,
    check_instance_type,
    check_kms_key,
    check_vpc,
    run_preflight,
)

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-1"
# A Capacity Block's end (they end at 11:30 UTC), two weeks ahead: its scale to 0 must not be past.
BLOCK_END = (datetime.now(UTC) + timedelta(days=14)).replace(hour=11, minute=30, second=0, microsecond=0)


def dev_data() -> dict:
    return read_stack_file(ROOT / "Pulumi.dev.yaml")


def reserved(kind: str = "capacity-reservation", ends_at: str | None = None):
    """dev's training group (2 x p5.48xlarge) alone, targeting reservation cr-0a1b2c3d4e5f60718."""
    data = dev_data()
    group = data["acceleratorNodeGroups"][0]
    data["acceleratorNodeGroups"] = [group]  # serving's on-demand group would bring the On-Demand quota back
    group["capacity"] = {"type": kind, "reservationId": "cr-0a1b2c3d4e5f60718", "availabilityZone": "us-east-1a"}
    if kind == "capacity-block":
        group["placementGroup"] = False
        group["capacity"]["endsAt"] = ends_at or BLOCK_END.isoformat()
    return from_mapping(data)


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def reservation_xml(
    stub,
    cr: str,
    state: str = "active",
    az: str = "us-east-1a",
    total: int = 2,
    available: int = 2,
    rtype: str = "default",
    itype: str = "p5.48xlarge",
    end: datetime | None = None,
):
    """A DescribeCapacityReservations answer as EC2 writes it (moto does not implement the API)."""
    return stub.Answer(
        body=f"""<?xml version="1.0" encoding="UTF-8"?>
<DescribeCapacityReservationsResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
  <requestId>stub</requestId>
  <capacityReservationSet><item>
    <capacityReservationId>{cr}</capacityReservationId><instanceType>{itype}</instanceType>
    <instancePlatform>Linux/UNIX</instancePlatform><availabilityZone>{az}</availabilityZone>
    <totalInstanceCount>{total}</totalInstanceCount><availableInstanceCount>{available}</availableInstanceCount>
    <state>{state}</state><reservationType>{rtype}</reservationType>
    <startDate>2026-12-10T11:30:00.000Z</startDate>{f"<endDate>{end:%Y-%m-%dT%H:%M:%S.000Z}</endDate>" if end else ""}
  </item></capacityReservationSet>
</DescribeCapacityReservationsResponse>"""
    )


def quota(stub, value: float):
    """A GetServiceQuota answer as Service Quotas writes it (moto knows only VPC quotas)."""
    return stub.json_answer(
        {
            "Quota": {
                "ServiceCode": "ec2",
                "QuotaCode": P_QUOTA_CODE,
                "Value": value,
                "QuotaName": "Running On-Demand P instances",
                "Unit": "None",
            }
        }
    )


# -- instance types ------------------------------------------------------------------------------


def test_every_catalog_type_is_covered_by_the_p_quota():
    assert all(name.startswith(("p", "trn")) for name in catalog.CATALOG)  # trn: the Trn quota (quota_of)


def test_dev_passes_offering_and_catalog_and_warns_on_quota(moto_aws):
    checks = by_name(run_preflight(from_mapping(dev_data())))
    assert set(checks) == {"offering p5.48xlarge", "instance type p5.48xlarge", f"quota {P_QUOTA_CODE}"}
    assert checks["offering p5.48xlarge"].result == "pass"
    assert checks["instance type p5.48xlarge"].result == "pass"
    assert "GPU memory MiB 81920" in checks["instance type p5.48xlarge"].detail
    q = checks[f"quota {P_QUOTA_CODE}"]
    assert q.result == "warn" and "cannot be checked" in q.detail and "GetServiceQuota" in q.detail
    assert "must cover 576 vCPUs" in q.fix  # (2 training + 1 serving nodes) x 192 vCPUs


def offering_for(instance_type: str) -> Check:
    data = dev_data()
    data["acceleratorNodeGroups"][0]["instanceType"] = instance_type
    return by_name(run_preflight(from_mapping(data)))[f"offering {instance_type}"]


def test_type_not_offered_in_az_fails_and_names_azs_that_offer_it(moto_aws):
    offering = offering_for("p4de.24xlarge")
    assert offering.result == "fail"
    assert offering.detail == "EC2 does not offer p4de.24xlarge in us-east-1a"
    offered = sorted(
        {
            o["Location"]
            for o in boto3.client("ec2", region_name=REGION).describe_instance_type_offerings(
                LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": ["p4de.24xlarge"]}]
            )["InstanceTypeOfferings"]
        }
    )
    assert offered and "us-east-1a" not in offered
    assert offering.fix.startswith(f"choose an AZ that offers it: {', '.join(offered)}")


def test_type_not_offered_in_the_region_says_so(moto_aws):
    offering = offering_for("p5e.48xlarge")  # moto's us-east-1 data has no p5e offering
    assert offering.result == "fail"
    assert offering.fix.startswith("no AZ of us-east-1 offers it: choose another region")


# moto 5.2.5 describes every catalog type but p6e-gb200 (sold only inside UltraServers).
NOT_IN_MOTO = {"p6e-gb200.36xlarge"}
# Trainium2: moto's NeuronInfo gives 524288 MiB per device (AWS's Neuron docs: 96 GiB) and none for trn2u,
# so preflight warns on them; tests/tools/test_preflight_trn2.py holds what must match.
NEURON_WARNED = {"trn2.48xlarge", "trn2u.48xlarge"}


@pytest.mark.parametrize("instance_type", sorted(set(catalog.CATALOG) - NOT_IN_MOTO - NEURON_WARNED))
def test_catalog_against_what_ec2_reports(moto_aws, instance_type):
    """moto carries AWS's DescribeInstanceTypes data: every catalog figure must match it."""
    check = check_instance_type(Aws(REGION), instance_type)
    assert check.result == "pass", check.detail


def test_p6_card_layouts_and_architecture_are_compared_with_ec2(moto_aws):
    """The figures the launch templates are built from, as EC2 reports them (docs/hardware.md)."""
    b300 = check_instance_type(Aws(REGION), "p6-b300.48xlarge").detail
    assert "accelerator B300" in b300 and "max EFA interfaces 16" in b300 and "network cards 17" in b300
    assert "card 0 EFA False" in b300 and "architecture x86_64" in b300 and "GPU memory MiB 275040" in b300
    b200 = check_instance_type(Aws(REGION), "p6-b200.48xlarge").detail
    assert "max EFA interfaces 8" in b200 and "network cards 8" in b200 and "card 0 EFA True" in b200


def test_type_ec2_does_not_describe_warns_that_it_could_not_be_compared(moto_aws):
    check = check_instance_type(Aws(REGION), "p6e-gb200.36xlarge")
    assert check.result == "warn"
    assert check.detail == (
        "EC2 in us-east-1 does not describe p6e-gb200.36xlarge: the catalog's figures could not be compared"
    )
    assert "aws ec2 describe-instance-types --instance-types p6e-gb200.36xlarge" in check.fix


def test_catalog_mismatch_names_each_field(moto_aws, monkeypatch):
    # The network-card count follows the EFA count (plus card 0 where it is ENA-only), so both differ.
    wrong = dataclasses.replace(catalog.CATALOG["p5.48xlarge"], efa_interfaces=16, accelerators=4)
    monkeypatch.setitem(catalog.CATALOG, "p5.48xlarge", wrong)
    check = check_instance_type(Aws(REGION), "p5.48xlarge")
    assert check.result == "fail"
    assert check.detail == (
        "catalog differs from EC2: GPUs: catalog 4, EC2 8; max EFA interfaces: catalog 16, EC2 32; "
        "network cards: catalog 16, EC2 32"
    )
    arm = dataclasses.replace(catalog.CATALOG["p6-b300.48xlarge"], arch="arm64", card0_efa=True)
    monkeypatch.setitem(catalog.CATALOG, "p6-b300.48xlarge", arm)
    check = check_instance_type(Aws(REGION), "p6-b300.48xlarge")
    assert check.detail == (
        "catalog differs from EC2: network cards: catalog 16, EC2 17; card 0 EFA: catalog True, "
        "EC2 False; architecture: catalog arm64, EC2 x86_64"
    )


# -- capacity reservations / Capacity Blocks -----------------------------------------------------


def test_reservation_without_the_api_says_it_cannot_be_checked(moto_aws):
    check = by_name(run_preflight(reserved()))["capacity cr-0a1b2c3d4e5f60718"]
    assert check.result == "warn"
    assert check.detail.startswith("cannot be checked")
    assert "aws ec2 describe-capacity-reservations --capacity-reservation-ids cr-0a1b2c3d4e5f60718" in check.fix


def test_active_reservation_in_the_az_covering_the_nodes_passes(moto_aws):
    moto_aws.answer(
        "DescribeCapacityReservations", reservation_xml(moto_aws, "cr-0a1b2c3d4e5f60718", total=4, available=3)
    )
    check = by_name(run_preflight(reserved()))["capacity cr-0a1b2c3d4e5f60718"]
    assert check.result == "pass", check.detail
    assert check.detail == "default p5.48xlarge in us-east-1a: 3/4 available, 2 needed (gpu-p5); active"


def test_reservation_in_wrong_az_too_small_and_expired_fails_with_each_reason(moto_aws):
    moto_aws.answer(
        "DescribeCapacityReservations",
        reservation_xml(
            moto_aws,
            "cr-0a1b2c3d4e5f60718",
            state="expired",
            az="us-east-1b",
            total=2,
            available=1,
            itype="p4d.24xlarge",
        ),
    )
    check = by_name(run_preflight(reserved()))["capacity cr-0a1b2c3d4e5f60718"]
    assert check.result == "fail"
    assert check.detail == (
        "in us-east-1b, not the GPU AZ us-east-1a; reserves p4d.24xlarge, node groups use "
        "p5.48xlarge; 1 of 2 instances available, gpu-p5 need 2; state expired, not active"
    )


def test_unknown_reservation_fails(moto_aws):
    moto_aws.answer(
        "DescribeCapacityReservations",
        moto_aws.ec2_error(
            "InvalidCapacityReservationId.NotFound", "The capacity reservation ID 'cr-0a1b2c3d4e5f60718' does not exist"
        ),
    )
    check = by_name(run_preflight(reserved()))["capacity cr-0a1b2c3d4e5f60718"]
    assert check.result == "fail"
    assert check.detail.startswith("capacity-reservation cr-0a1b2c3d4e5f60718 not found in us-east-1")


def test_scheduled_capacity_block_warns_and_a_plain_reservation_is_not_a_block(moto_aws):
    moto_aws.answer(
        "DescribeCapacityReservations",
        reservation_xml(moto_aws, "cr-0a1b2c3d4e5f60718", state="scheduled", rtype="capacity-block", end=BLOCK_END),
    )
    cfg = reserved(kind="capacity-block")
    checks = by_name(run_preflight(cfg))
    block = checks["capacity cr-0a1b2c3d4e5f60718"]
    assert block.result == "warn" and "Capacity Block is scheduled, starts 2026-12-10 11:30:00" in block.detail
    assert f"quota {P_QUOTA_CODE}" not in checks  # Capacity Blocks do not use the On-Demand quota

    moto_aws.answer("DescribeCapacityReservations", reservation_xml(moto_aws, "cr-0a1b2c3d4e5f60718", rtype="default"))
    check = by_name(run_preflight(cfg))["capacity cr-0a1b2c3d4e5f60718"]
    assert check.result == "fail"
    assert "config says capacity-block, EC2 reports reservation type default" in check.detail


# -- quota -----------------------------------------------------------------------------------------


def test_quota_covering_the_vcpus_passes_and_a_short_one_fails(moto_aws):
    cfg = from_mapping(dev_data())
    moto_aws.answer("GetServiceQuota", quota(moto_aws, 576))
    ok = by_name(run_preflight(cfg))[f"quota {P_QUOTA_CODE}"]
    assert ok.result == "pass" and "quota 576 vCPUs, gpu-p5, gpu-p5-serve need 576" in ok.detail

    moto_aws.answer("GetServiceQuota", quota(moto_aws, 192))
    short = by_name(run_preflight(cfg))[f"quota {P_QUOTA_CODE}"]
    assert short.result == "fail"
    assert f"--quota-code {P_QUOTA_CODE} --desired-value 576" in short.fix


def test_quota_access_denied_is_a_warning_with_a_clear_message(moto_aws):
    moto_aws.answer(
        "GetServiceQuota",
        moto_aws.json_error(
            "AccessDeniedException",
            "User: arn:aws:iam::123456789012:user/ci is not authorized to perform: servicequotas:GetServiceQuota",
        ),
    )
    check = by_name(run_preflight(from_mapping(dev_data())))[f"quota {P_QUOTA_CODE}"]
    assert check.result == "warn"
    assert check.detail.startswith("access denied calling GetServiceQuota (AccessDeniedException: User: ")
    assert "grant the IAM permission for GetServiceQuota" in check.fix


# -- existing VPC, subnets, bucket, KMS key ---------------------------------------------------------
# An existing VPC is checked through the config (network.existingVpcId, existingPrivateSubnetIds,
# existingGpuSubnetId), as `supernode preflight` sees it.


def test_vpc_states(moto_aws):
    ec2 = boto3.client("ec2", region_name=REGION)
    vpc = ec2.create_vpc(CidrBlock="10.20.0.0/16")["Vpc"]["VpcId"]
    aws = Aws(REGION)
    assert check_vpc(aws, vpc, "10.20.0.0/16").result == "pass"
    wrong_cidr = check_vpc(aws, vpc, "10.99.0.0/16")
    assert wrong_cidr.result == "fail" and "do not include network.vpcCidr 10.99.0.0/16" in wrong_cidr.detail
    gone = check_vpc(aws, "vpc-0123456789abcdef0", "10.20.0.0/16")
    assert gone.result == "fail" and gone.detail == "VPC vpc-0123456789abcdef0 not found in us-east-1"


def existing_vpc_state() -> dict[str, str]:
    """An existing VPC as dev's network expects it (vpcCidr 10.20.0.0/16, AZs a and b, GPU AZ a), plus a
    stray subnet in b and one in another VPC."""
    ec2 = boto3.client("ec2", region_name=REGION)
    vpc = ec2.create_vpc(CidrBlock="10.20.0.0/16")["Vpc"]["VpcId"]

    def subnet(cidr: str, az: str, in_vpc: str = vpc) -> str:
        return ec2.create_subnet(VpcId=in_vpc, CidrBlock=cidr, AvailabilityZone=az)["Subnet"]["SubnetId"]

    other_vpc = ec2.create_vpc(CidrBlock="10.30.0.0/16")["Vpc"]["VpcId"]
    return {
        "vpc": vpc,
        "a": subnet("10.20.0.0/19", "us-east-1a"),
        "b": subnet("10.20.32.0/19", "us-east-1b"),
        "gpu": subnet("10.20.64.0/18", "us-east-1a"),
        "stray_b": subnet("10.20.128.0/19", "us-east-1b"),
        "elsewhere": subnet("10.30.0.0/19", "us-east-1a", other_vpc),
        "elsewhere_vpc": other_vpc,
    }


def in_existing_vpc(vpc: str, private: list[str], gpu: str):
    data = dev_data()
    net = {
        k: v
        for k, v in data["network"].items()
        if k not in ("privateSubnetCidrs", "publicSubnetCidrs", "gpuSubnetCidr")
    }
    data["network"] = {
        **net,
        "existingVpcId": vpc,
        "existingPrivateSubnetIds": private,
        "existingGpuSubnetId": gpu,
        "natGateway": False,
    }
    return from_mapping(data)


def test_existing_vpc_matching_the_config_passes(moto_aws):
    s = existing_vpc_state()
    checks = by_name(run_preflight(in_existing_vpc(s["vpc"], [s["a"], s["b"]], s["gpu"])))
    assert checks[f"vpc {s['vpc']}"].result == "pass"
    subnets = checks["subnets"]
    assert subnets.result == "pass", subnets.detail
    assert subnets.detail == (
        f"3 exist in {s['vpc']}: {s['a']} (us-east-1a), {s['b']} (us-east-1b), {s['gpu']} (us-east-1a)"
    )


def test_existing_subnets_in_the_wrong_az_or_vpc_or_missing_fail_naming_each(moto_aws):
    s = existing_vpc_state()
    missing = "subnet-0123456789abcdef0"
    checks = by_name(run_preflight(in_existing_vpc(s["vpc"], [s["elsewhere"], missing], s["stray_b"])))
    assert checks[f"vpc {s['vpc']}"].result == "pass"
    subnets = checks["subnets"]
    assert subnets.result == "fail"
    assert subnets.detail == (
        f"network.existingPrivateSubnetIds[0] {s['elsewhere']} is in {s['elsewhere_vpc']}, not {s['vpc']}; "
        f"network.existingPrivateSubnetIds[1] {missing} not found; "
        f"network.existingGpuSubnetId {s['stray_b']} is in us-east-1b, not the GPU AZ availabilityZone us-east-1a"
    )
    assert "network.existingPrivateSubnetIds" in subnets.fix and "network.existingGpuSubnetId" in subnets.fix


def test_private_subnet_must_be_in_its_configured_az(moto_aws):
    s = existing_vpc_state()
    swapped = by_name(run_preflight(in_existing_vpc(s["vpc"], [s["b"], s["a"]], s["gpu"])))["subnets"]
    assert swapped.result == "fail"
    assert swapped.detail == (
        f"network.existingPrivateSubnetIds[0] {s['b']} is in us-east-1b, not network.availabilityZones[0] us-east-1a; "
        f"network.existingPrivateSubnetIds[1] {s['a']} is in us-east-1a, not network.availabilityZones[1] us-east-1b"
    )


def test_existing_vpc_that_is_gone_fails(moto_aws):
    s = existing_vpc_state()
    checks = by_name(run_preflight(in_existing_vpc("vpc-0123456789abcdef0", [s["a"], s["b"]], s["gpu"])))
    assert checks["vpc vpc-0123456789abcdef0"].result == "fail"
    assert checks["subnets"].result == "fail" and "not vpc-0123456789abcdef0" in checks["subnets"].detail


def test_bucket_exists_and_is_encrypted(moto_aws):
    s3 = boto3.client("s3", region_name=REGION)
    encrypted, plain, missing = (moto_aws.unique(n) for n in ("data-encrypted", "data-plain", "data-missing"))
    s3.create_bucket(Bucket=encrypted)
    s3.put_bucket_encryption(
        Bucket=encrypted,
        ServerSideEncryptionConfiguration={
            "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": "alias/x"}}]
        },
    )
    s3.create_bucket(Bucket=plain)
    s3.delete_bucket_encryption(Bucket=plain)
    aws = Aws(REGION)
    ok = check_bucket(aws, encrypted)
    assert ok.result == "pass" and ok.detail == "exists, encrypted with aws:kms (alias/x)"
    bare = check_bucket(aws, plain)
    assert bare.result == "fail" and bare.detail == "exists but has no default encryption"
    gone = check_bucket(aws, missing)
    assert gone.result == "fail" and gone.detail == f"bucket {missing} does not exist"


def test_existing_bucket_is_checked_from_the_config(moto_aws):
    data = dev_data()
    data["storage"].update(bucketName="supernode-dev-existing", existingBucket=True)
    check = by_name(run_preflight(from_mapping(data)))["bucket supernode-dev-existing"]
    assert check.result == "fail" and "does not exist" in check.detail


def test_kms_key_states(moto_aws):
    kms = boto3.client("kms", region_name=REGION)
    enabled = kms.create_key()["KeyMetadata"]["Arn"]
    disabled, doomed = (kms.create_key()["KeyMetadata"] for _ in range(2))
    kms.disable_key(KeyId=disabled["KeyId"])
    kms.schedule_key_deletion(KeyId=doomed["KeyId"], PendingWindowInDays=7)
    disabled, doomed = disabled["Arn"], doomed["Arn"]
    aws = Aws(REGION)
    assert check_kms_key(aws, enabled).result == "pass"
    off = check_kms_key(aws, disabled)
    assert off.result == "fail" and off.detail == f"{disabled} is Disabled" and "enable-key" in off.fix
    pending = check_kms_key(aws, doomed)
    assert pending.result == "fail" and "cancel-key-deletion" in pending.fix
    unknown = "arn:aws:kms:us-east-1:123456789012:key/00000000-0000-0000-0000-000000000000"
    assert check_kms_key(aws, unknown).detail == f"{unknown} not found"


def test_kms_key_from_the_config(moto_aws):
    key = boto3.client("kms", region_name=REGION).create_key()["KeyMetadata"]["Arn"]
    data = dev_data()
    data["identity"] = {"kmsKeyArn": key}
    assert by_name(run_preflight(from_mapping(data)))["kms key"].result == "pass"


# -- errors: access denied, throttling, timeouts, unreachable -----------------------------------------


def test_access_denied_fails_that_check_and_the_others_still_run(moto_aws):
    moto_aws.answer(
        "DescribeInstanceTypes",
        moto_aws.ec2_error(
            "UnauthorizedOperation",
            "You are not authorized to perform this operation. User: "
            "arn:aws:iam::123456789012:user/ci is not authorized to perform: ec2:DescribeInstanceTypes",
            status=403,
        ),
    )
    checks = by_name(run_preflight(from_mapping(dev_data())))
    denied = checks["instance type p5.48xlarge"]
    assert denied.result == "fail"
    assert denied.detail.startswith("access denied calling DescribeInstanceTypes (UnauthorizedOperation: ")
    assert "ec2:DescribeInstanceTypes" in denied.detail
    assert checks["offering p5.48xlarge"].result == "pass"


def test_throttling_is_reported_per_check(moto_aws):
    moto_aws.answer(
        "DescribeInstanceTypeOfferings", moto_aws.ec2_error("RequestLimitExceeded", "Request limit exceeded.", 503)
    )
    checks = by_name(run_preflight(from_mapping(dev_data())))
    assert checks["offering p5.48xlarge"].detail == (
        "throttled by AWS calling DescribeInstanceTypeOfferings after 1 attempt(s) (RequestLimitExceeded)"
    )
    assert checks["instance type p5.48xlarge"].result == "pass"


def test_a_slow_answer_times_out_quickly(moto_aws):
    moto_aws.answer("DescribeInstanceTypes", moto_aws.Answer(delay_s=6.0))
    # 2 s leaves moto time to answer the other checks; the client gives up on the stub after it.
    checks = by_name(run_preflight(from_mapping(dev_data()), Aws(REGION, read_timeout=2.0)))
    slow = checks["instance type p5.48xlarge"]
    assert slow.result == "fail" and slow.detail == f"timed out talking to {moto_aws.url}"
    assert checks["offering p5.48xlarge"].result == "pass"


def test_unreachable_endpoint_gives_a_message_per_check_and_no_traceback(moto_aws, monkeypatch, capsys):
    closed = moto_aws.closed_url()
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    assert main(["preflight", "--stack", "dev", "--root", str(ROOT), "--json"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "Traceback" not in captured.out + captured.err
    ec2 = [c for c in out["checks"] if not c["name"].startswith("quota")]
    assert ec2 and all(c["result"] == "fail" and c["detail"] == f"AWS endpoint unreachable: {closed}" for c in ec2)
    assert all("check network access to AWS" in c["fix"] for c in ec2)


# -- command line ------------------------------------------------------------------------------------


def test_cli_table_and_exit_codes(moto_aws, capsys):
    assert main(["preflight", "--stack", "dev", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    for word in (
        "check",
        "result",
        "detail",
        "fix",
        "offering p5.48xlarge",
        "pass",
        "warn",
        "3 checks: 2 pass, 0 fail, 1 warn",
    ):
        assert word in out
    moto_aws.answer("DescribeInstanceTypes", moto_aws.ec2_error("UnauthorizedOperation", "no", 403))
    assert main(["preflight", "--stack", "dev", "--root", str(ROOT)]) == 1


def test_cli_json_is_stable(moto_aws, capsys, tmp_path):
    stack = tmp_path / "Pulumi.reserved.yaml"
    doc = yaml.safe_load((ROOT / "Pulumi.prod.yaml").read_text())
    stack.write_text(yaml.safe_dump(doc))
    moto_aws.answer("GetServiceQuota", quota(moto_aws, 1000))
    runs = []
    for _ in range(2):
        assert main(["preflight", "--config", str(stack), "--json"]) == 1  # quota 1000 < 18 x 192
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1]
    out = json.loads(runs[0])
    assert sorted(out) == ["checks", "command", "counts", "ok", "stack"]
    assert out["command"] == "preflight" and out["stack"] == "reserved" and out["ok"] is False
    assert [sorted(c) for c in out["checks"]] == [["detail", "fix", "name", "result"]] * len(out["checks"])
    names = [c["name"] for c in out["checks"]]
    assert (
        names
        == sorted(names)
        == [
            "capacity cr-0a1b2c3d4e5f60718",
            "capacity cr-0c4d5e6f708192a3b",
            "capacity cr-0f1e2d3c4b5a69788",
            "instance type p5.48xlarge",
            "offering p5.48xlarge",
            f"quota {P_QUOTA_CODE}",
        ]
    )
    assert out["counts"] == {"fail": 1, "pass": 2, "warn": 3}


def test_cli_bad_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "Pulumi.bad.yaml"
    bad.write_text("config: [1, 2]\n")
    assert main(["preflight", "--config", str(bad)]) == 2
    assert "expected a top-level 'config:' mapping" in capsys.readouterr().err


def test_missing_credentials_are_reported_once(moto_aws, monkeypatch):
    """Issue 19: no credentials is one failed check, not the same failure once per check."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup on a dev machine
    checks = run_preflight(from_mapping(dev_data()))
    assert [(c.name, c.result) for c in checks] == [("aws credentials", "fail")]
    assert checks[0].detail.startswith("no usable AWS credentials: no check could run")


def test_no_credentials_is_said_once(moto_aws, monkeypatch, capsys, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to fall back on
    assert main(["preflight", "--stack", "prod", "--root", str(ROOT)]) == 1
    out = capsys.readouterr().out
    assert out.count("no usable AWS credentials") == 1, out
    assert "fix aws credentials: configure credentials" in out and "1 checks: 0 pass, 1 fail, 0 warn" in out


# -- UltraServers: Local Zone opt-in, Capacity Block window ------------------------------------------


def zones_xml(stub, zone: str, status: str):
    """A DescribeAvailabilityZones answer for a Local Zone as EC2 writes it (moto knows no Local Zones)."""
    return stub.Answer(
        body=f"""<?xml version="1.0" encoding="UTF-8"?>
<DescribeAvailabilityZonesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
  <requestId>stub</requestId>
  <availabilityZoneInfo><item>
    <zoneName>{zone}</zoneName><zoneState>available</zoneState><regionName>us-east-1</regionName>
    <groupName>us-east-1-dfw-2</groupName><optInStatus>{status}</optInStatus><zoneType>local-zone</zoneType>
  </item></availabilityZoneInfo>
</DescribeAvailabilityZonesResponse>"""
    )


def gb200_config():
    return from_mapping(read_stack_file(ROOT / "Pulumi.gb200.yaml"))


def test_local_zone_must_be_opted_in(moto_aws):
    moto_aws.answer("DescribeAvailabilityZones", zones_xml(moto_aws, "us-east-1-dfw-2a", "not-opted-in"))
    checks = by_name(run_preflight(gb200_config()))
    zone = checks["zone us-east-1-dfw-2a"]
    assert zone.result == "fail" and zone.detail == "us-east-1-dfw-2a (local-zone) is not opted in"
    assert zone.fix == "aws ec2 modify-availability-zone-group --group-name us-east-1-dfw-2 --opt-in-status opted-in"
    assert checks["instance type p6e-gb200.36xlarge"].result == "warn"  # not described: not compared
    assert f"quota {P_QUOTA_CODE}" not in checks  # Capacity Blocks only

    moto_aws.answer("DescribeAvailabilityZones", zones_xml(moto_aws, "us-east-1-dfw-2a", "opted-in"))
    ok = by_name(run_preflight(gb200_config()))["zone us-east-1-dfw-2a"]
    assert ok.result == "pass" and ok.detail == "us-east-1-dfw-2a (local-zone, group us-east-1-dfw-2): opted-in"


def test_region_azs_need_no_opt_in_check(moto_aws):
    assert not [c for c in run_preflight(from_mapping(dev_data())) if c.name.startswith("zone ")]


def test_capacity_block_reports_its_window(moto_aws):
    moto_aws.answer(
        "DescribeCapacityReservations",
        reservation_xml(moto_aws, "cr-0a1b2c3d4e5f60718", state="active", rtype="capacity-block", end=BLOCK_END),
    )
    check = by_name(run_preflight(reserved(kind="capacity-block")))["capacity cr-0a1b2c3d4e5f60718"]
    assert check.result == "pass", check.detail
    assert "capacity-block p5.48xlarge in us-east-1a: 2/2 available, 2 needed (gpu-p5)" in check.detail
    assert f"window 2026-12-10 11:30:00+00:00 to {BLOCK_END}" in check.detail
    assert f"the node groups scale to 0 at {BLOCK_END - timedelta(minutes=40)}" in check.detail


def test_capacity_block_end_must_be_ec2s_end_date_and_ahead(moto_aws):
    """The node group's scale to 0 is timed from capacity.endsAt: it must be the block's EndDate."""
    cr = "cr-0a1b2c3d4e5f60718"
    moto_aws.answer(
        "DescribeCapacityReservations", reservation_xml(moto_aws, cr, rtype="capacity-block", end=BLOCK_END)
    )
    a_day_late = (BLOCK_END + timedelta(days=1)).isoformat()
    check = by_name(run_preflight(reserved("capacity-block", ends_at=a_day_late)))[f"capacity {cr}"]
    assert check.result == "fail"
    assert f"gpu-p5: capacity.endsAt {BLOCK_END + timedelta(days=1)} but EC2's EndDate is {BLOCK_END}" in check.detail
    # The same instant written with another offset is the same end.
    same = BLOCK_END.astimezone(timezone(timedelta(hours=-6))).isoformat()
    assert by_name(run_preflight(reserved("capacity-block", ends_at=same)))[f"capacity {cr}"].result == "pass"
    # A block ending within 40 minutes: the scale to 0 is past, and AWS would refuse its schedule.
    soon = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=20)
    moto_aws.answer("DescribeCapacityReservations", reservation_xml(moto_aws, cr, rtype="capacity-block", end=soon))
    check = by_name(run_preflight(reserved("capacity-block", ends_at=soon.isoformat())))[f"capacity {cr}"]
    assert check.result == "fail"
    assert (
        f"the block ends {soon}: its node groups' scale to 0 at {soon - timedelta(minutes=40)} is past" in check.detail
    )
