"""`supernode verify` against a real moto server (fixture `moto_aws` in conftest.py).

Each test deploys the dev stack's resources into moto with boto3 (uniquely named), writes the
stack-outputs file the way `pulumi stack output --json --show-secrets` would, and runs verify.
moto's FSx does not report `Lifecycle`: alone, the FSx state check must warn; its pass/fail cases
patch moto's own DescribeFileSystems answer with a lifecycle on its way through the stub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import boto3
import pytest

from supernode.cli import main
from supernode.core.config import StackConfig, from_mapping, read_stack_file
from supernode.core.contract import CONTRACT_VERSION, StackOutputs
from supernode.core.plan import build_plan
from supernode.tools.awscheck import Aws, Check
from supernode.tools.verify import run_verify

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/eks"
SUBNET = "subnet-0123456789abcdef0"


# A valid outputs document; `deploy` fills in what it created. `plan` is not in the contract: pulumi
# prints every export, and verify reads only the contract's keys.
OUTPUTS = StackOutputs(
    contract_version=CONTRACT_VERSION,
    cluster_name="sn-eks",
    cluster_endpoint="https://eks.example",
    cluster_version="1.33",
    oidc_issuer_url="https://oidc.example/id/X",
    oidc_provider_arn="arn:aws:iam::123456789012:oidc-provider/oidc.example/id/X",
    node_group_names=["sn-gpu-p5"],
    system_node_group_name="sn-system",
    vpc_id="vpc-0123456789abcdef0",
    private_subnet_ids=[SUBNET],
    gpu_subnet_id=SUBNET,
    efa_security_group_id="sg-0123456789abcdef0",
    bucket_name="sn-data",
    dataset_prefix="datasets/fineweb-sample/",
    checkpoint_prefix="checkpoints/dev/",
    fsx_id="fs-0123456789abcdef0",
    fsx_dns_name="fs.example",
    fsx_mount_name="abcdefgh",
    kms_key_arns={},
    sns_topic_arn="arn:aws:sns:us-east-1:1:t",
    trainer_role_arn="arn:aws:iam::123456789012:role/trainer",
    log_group_names=[],
    alarm_names=[],
    kubeconfig="apiVersion: v1\nkind: Config\n",
).model_dump() | {"plan": {"world_size": 16}}


@pytest.fixture(scope="module")
def dev() -> StackConfig:
    return from_mapping(read_stack_file(ROOT / "Pulumi.dev.yaml"))


@dataclass(frozen=True)
class Drift:
    """How the deployed state differs from the config (the defaults deploy it as configured)."""

    cluster_version: str | None = None
    gpu_type: str | None = None
    gpu_desired: int | None = None
    system_max: int | None = None
    fsx_per_unit: int | None = None
    lifecycle_days: dict[str, int] = field(default_factory=dict)
    sse: str = "aws:kms"
    public_access: bool = True
    alarms_created: int = 2
    retention: int | None = None  # of the second log group: None as configured, 0 none (kept forever)
    subscribe: bool = True


NO_DRIFT = Drift()


def deploy(stub, cfg: StackConfig, drift: Drift = NO_DRIFT) -> dict:
    """Create the stack's resources in moto and return its outputs, as the JSON pulumi would print."""
    base = stub.unique("sn")
    plan = build_plan("dev", cfg)
    eks = boto3.client("eks", region_name=REGION)
    cluster = f"{base}-eks"
    eks.create_cluster(
        name=cluster,
        version=drift.cluster_version or cfg.cluster.kubernetes_version,
        roleArn=ROLE,
        resourcesVpcConfig={"subnetIds": [SUBNET]},
    )
    names = []
    for g in cfg.accelerator_node_groups:
        names.append(f"{base}-{g.name}")
        n = drift.gpu_desired or g.nodes
        eks.create_nodegroup(
            clusterName=cluster,
            nodegroupName=names[-1],
            nodeRole=ROLE,
            subnets=[SUBNET],
            instanceTypes=[drift.gpu_type or g.instance_type],
            scalingConfig={"minSize": n, "desiredSize": n, "maxSize": n},
        )
    sng = cfg.system_node_group
    eks.create_nodegroup(
        clusterName=cluster,
        nodegroupName=f"{base}-system",
        nodeRole=ROLE,
        subnets=[SUBNET],
        instanceTypes=[sng.instance_type],
        scalingConfig={
            "minSize": sng.min_size,
            "desiredSize": sng.desired_size,
            "maxSize": drift.system_max or sng.max_size,
        },
    )

    fsx = boto3.client("fsx", region_name=REGION).create_file_system(
        FileSystemType="LUSTRE",
        StorageCapacity=plan.checkpoint.fsx_capacity_gib,
        SubnetIds=[SUBNET],
        LustreConfiguration={
            "DeploymentType": "PERSISTENT_2",
            "PerUnitStorageThroughput": drift.fsx_per_unit or cfg.storage.fsx.per_unit_throughput,
        },
    )["FileSystem"]

    key = boto3.client("kms", region_name=REGION).create_key()["KeyMetadata"]["Arn"]
    bucket = f"{base}-data"
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=bucket)
    sse = {"SSEAlgorithm": drift.sse} | ({"KMSMasterKeyID": key} if drift.sse == "aws:kms" else {})
    s3.put_bucket_encryption(
        Bucket=bucket, ServerSideEncryptionConfiguration={"Rules": [{"ApplyServerSideEncryptionByDefault": sse}]}
    )
    s3.put_public_access_block(
        Bucket=bucket,
        PublicAccessBlockConfiguration={
            "BlockPublicAcls": True,
            "IgnorePublicAcls": True,
            "BlockPublicPolicy": drift.public_access,
            "RestrictPublicBuckets": drift.public_access,
        },
    )
    lc = cfg.storage.lifecycle.model_dump() | drift.lifecycle_days
    s3.put_bucket_lifecycle_configuration(
        Bucket=bucket,
        LifecycleConfiguration={
            "Rules": [
                {
                    "ID": "checkpoints",
                    "Status": "Enabled",
                    "Filter": {"Prefix": cfg.storage.checkpoint_prefix},
                    "Transitions": [{"Days": lc["checkpoint_transition_days"], "StorageClass": "STANDARD_IA"}],
                    "Expiration": {"Days": lc["checkpoint_expire_days"]},
                },
                {
                    "ID": "logs",
                    "Status": "Enabled",
                    "Filter": {"Prefix": cfg.storage.log_prefix},
                    "Expiration": {"Days": lc["log_expire_days"]},
                },
                {
                    "ID": "all",
                    "Status": "Enabled",
                    "Filter": {"Prefix": ""},
                    "NoncurrentVersionExpiration": {"NoncurrentDays": lc["noncurrent_expire_days"]},
                    "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": lc["abort_multipart_days"]},
                },
            ]
        },
    )

    topic = boto3.client("sns", region_name=REGION).create_topic(Name=f"{base}-alerts")["TopicArn"]
    if drift.subscribe:
        boto3.client("sns", region_name=REGION).subscribe(
            TopicArn=topic, Protocol="email", Endpoint=cfg.monitoring.notification_email
        )
    alarms = [f"{base}-gpu-util-low", f"{base}-fsx-free-low"]
    cw = boto3.client("cloudwatch", region_name=REGION)
    for name in alarms[: drift.alarms_created]:
        cw.put_metric_alarm(
            AlarmName=name,
            MetricName="m",
            Namespace="supernode",
            Statistic="Average",
            Period=300,
            EvaluationPeriods=1,
            Threshold=1,
            ComparisonOperator="LessThanThreshold",
            AlarmActions=[topic],
        )
    groups = [f"/aws/eks/{cluster}/cluster", f"/supernode/{base}/training"]
    logs = boto3.client("logs", region_name=REGION)
    for g in groups:
        logs.create_log_group(logGroupName=g)
    logs.put_retention_policy(logGroupName=groups[0], retentionInDays=cfg.monitoring.log_retention_days)
    if drift.retention != 0:
        logs.put_retention_policy(
            logGroupName=groups[1], retentionInDays=drift.retention or cfg.monitoring.log_retention_days
        )

    return OUTPUTS | {
        "cluster_name": cluster,
        "node_group_names": names,
        "system_node_group_name": f"{base}-system",
        "bucket_name": bucket,
        "checkpoint_prefix": cfg.storage.checkpoint_prefix,
        "fsx_id": fsx["FileSystemId"],
        "fsx_dns_name": fsx["DNSName"],
        "kms_key_arns": {"data": key},
        "sns_topic_arn": topic,
        "log_group_names": groups,
        "alarm_names": alarms,
    }


@pytest.fixture(scope="module")
def deployed(moto_aws_module, dev) -> dict:
    """The dev stack deployed as configured, shared by the tests that only read it."""
    return deploy(moto_aws_module, dev)


def with_lifecycle(stub, state: str) -> None:
    stub.patch_json(
        "DescribeFileSystems", lambda d: d | {"FileSystems": [fs | {"Lifecycle": state} for fs in d["FileSystems"]]}
    )


def verify(cfg: StackConfig, outputs: dict) -> dict[str, Check]:
    checks = run_verify(
        cfg,
        build_plan("dev", cfg),
        StackOutputs.model_validate({k: v for k, v in outputs.items() if k in StackOutputs.model_fields}),
        Aws(REGION),
    )
    return {c.name: c for c in checks}


def write(tmp_path: Path, outputs) -> Path:
    path = tmp_path / "outputs.json"
    path.write_text(outputs if isinstance(outputs, str) else json.dumps(outputs))
    return path


# -- the deployed stack as configured --------------------------------------------------------------


def test_stack_as_configured_passes_every_check(moto_aws, dev, deployed, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one table row per line, names unwrapped
    outputs = deployed
    with_lifecycle(moto_aws, "AVAILABLE")
    assert main(["verify", "--stack", "dev", "--root", str(ROOT), "--outputs", str(write(tmp_path, outputs))]) == 0
    out = capsys.readouterr().out
    assert "14 checks: 14 pass, 0 fail, 0 warn" in out  # dev's node groups: training's and serving's
    for name in (
        "eks cluster",
        "eks nodegroups",
        f"eks nodegroup {outputs['node_group_names'][0]}",
        "fsx state",
        "fsx throughput",
        "s3 lifecycle",
        "s3 encryption",
        "s3 public access block",
        "cloudwatch alarms",
        f"log group {outputs['log_group_names'][0]}",
        "sns subscription",
    ):
        assert name in out


def test_a_serving_request_joins_the_checks(moto_aws, dev, deployed, tmp_path, capsys, monkeypatch):
    """--serving-url: one completion through a real TLS server that wants the API key, the key read from
    the environment and the CA from the serving_ca file; the stack's served model name is asked for."""
    from supernode.core.credentials import generate
    from tests.tools.completions_server import Behaviour, completions_server

    monkeypatch.setenv("COLUMNS", "250")
    tls = generate(["localhost"], valid_days=1, ip_addresses=("127.0.0.1",))
    (tmp_path / "ca.pem").write_text(tls["ca_pem"], encoding="utf-8")
    monkeypatch.setenv("SUPERNODE_SERVING_API_KEY", tls["api_key"])
    with_lifecycle(moto_aws, "AVAILABLE")
    args = ["verify", "--stack", "dev", "--root", str(ROOT), "--outputs", str(write(tmp_path, deployed))]
    with completions_server(Behaviour(api_key=tls["api_key"]), tls) as (url, requests):
        serving = ["--serving-url", url, "--serving-ca", str(tmp_path / "ca.pem"), "--serving-expect", "Paris"]
        assert main([*args, *serving]) == 0
    out = capsys.readouterr().out
    assert "15 checks: 15 pass, 0 fail, 0 warn" in out and "serving request" in out
    assert [r["body"]["model"] for r in requests] == ["dev-vllm"]
    with completions_server(Behaviour(tokens=(" London",), api_key=tls["api_key"]), tls) as (url, _):
        serving = ["--serving-url", url, "--serving-ca", str(tmp_path / "ca.pem"), "--serving-expect", "Paris"]
        assert main([*args, *serving]) == 1
    assert "15 checks: 14 pass, 1 fail, 0 warn" in capsys.readouterr().out


def test_details_say_what_was_found(moto_aws, dev, deployed):
    outputs = deployed
    checks = verify(dev, outputs)
    plan = build_plan("dev", dev)
    assert checks["eks cluster"].detail == f"{outputs['cluster_name']} ACTIVE at Kubernetes 1.33"
    assert checks[f"eks nodegroup {outputs['node_group_names'][0]}"].detail == "ACTIVE, p5.48xlarge, desiredSize 2"
    assert checks[f"eks nodegroup {outputs['system_node_group_name']}"].detail == (
        "ACTIVE, m6i.xlarge, minSize 2, desiredSize 2, maxSize 3"
    )
    cap = plan.checkpoint.fsx_capacity_gib
    assert checks["fsx throughput"].detail == (
        f"{cap} GiB x 250 MB/s/TiB = {cap / 1024 * 250:.0f} MB/s; plan: {cap} GiB x 250 = "
        f"{plan.checkpoint.fsx_throughput_mb_s:.0f} MB/s"
    )
    assert checks["sns subscription"].detail == "email:ml-oncall@example.com"


def test_fsx_state_cannot_be_confirmed_without_a_lifecycle(moto_aws, dev, deployed):
    state = verify(dev, deployed)["fsx state"]
    assert state.result == "warn"
    assert "FSx did not report a lifecycle state" in state.detail


def test_fsx_still_creating_fails(moto_aws, dev, deployed):
    outputs = deployed
    with_lifecycle(moto_aws, "CREATING")
    state = verify(dev, outputs)["fsx state"]
    assert state.result == "fail" and state.detail == f"{outputs['fsx_id']} is CREATING, not AVAILABLE"


def test_cluster_not_active_fails(moto_aws, dev, deployed):
    outputs = deployed
    moto_aws.patch_json(
        f"GET /clusters/{outputs['cluster_name']}", lambda d: d | {"cluster": d["cluster"] | {"status": "UPDATING"}}
    )
    assert verify(dev, outputs)["eks cluster"].detail == f"{outputs['cluster_name']}: status UPDATING, not ACTIVE"


# -- drift: every check failing, each with its reason ------------------------------------------------


def test_drifted_stack_fails_each_check_with_its_reason(moto_aws, dev, tmp_path, capsys):
    drift = Drift(
        cluster_version="1.32",
        gpu_type="p4d.24xlarge",
        gpu_desired=1,
        system_max=5,
        fsx_per_unit=125,
        lifecycle_days={"checkpoint_expire_days": 30, "abort_multipart_days": 7},
        sse="AES256",
        public_access=False,
        alarms_created=1,
        retention=0,
        subscribe=False,
    )
    outputs = deploy(moto_aws, dev, drift)
    checks = verify(dev, outputs)
    gpu, system = outputs["node_group_names"][0], outputs["system_node_group_name"]
    plan = build_plan("dev", dev)
    expected = {
        "eks cluster": f"{outputs['cluster_name']}: Kubernetes 1.32, config says 1.33",
        f"eks nodegroup {gpu}": "instance types ['p4d.24xlarge'], expected [p5.48xlarge]; desiredSize 1, expected 2",
        # serving's group (role: serving, 1 node) drifted to the same instance type
        f"eks nodegroup {outputs['node_group_names'][1]}": "instance types ['p4d.24xlarge'], expected [p5.48xlarge]",
        f"eks nodegroup {system}": "maxSize 5, expected 3",
        "fsx throughput": f"below plan: {plan.checkpoint.fsx_capacity_gib} GiB x 125 MB/s/TiB",
        "s3 lifecycle": f"{outputs['bucket_name']} (checkpoints/dev/, logs/): checkpoint expiry days: expected 90, "
        "found [30]; abort multipart days: expected 3, found [7]",
        "s3 encryption": f"{outputs['bucket_name']} uses AES256, expected SSE-KMS (aws:kms)",
        "s3 public access block": f"{outputs['bucket_name']}: not set: BlockPublicPolicy, RestrictPublicBuckets",
        "cloudwatch alarms": f"1 of 2 missing: {outputs['alarm_names'][1]}",
        f"log group {outputs['log_group_names'][1]}": "no retention (kept forever); monitoring.logRetentionDays is 14",
        "sns subscription": f"{outputs['sns_topic_arn']} has no subscription, so alarms reach nobody",
    }
    for name, detail in expected.items():
        assert checks[name].result == "fail", (name, checks[name])
        assert checks[name].detail.startswith(detail), (name, checks[name].detail)
        assert checks[name].fix.startswith("run `pulumi up`")
    assert checks[f"log group {outputs['log_group_names'][0]}"].result == "pass"

    assert (
        main(["verify", "--stack", "dev", "--root", str(ROOT), "--outputs", str(write(tmp_path, outputs)), "--json"])
        == 1
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["counts"]["fail"] == len(expected)


def test_missing_resources_fail_as_not_found(moto_aws, dev, deployed):
    outputs = deployed
    gone = outputs | {
        "cluster_name": "sn-gone",
        "fsx_id": "fs-0123456789abcdef0",
        "bucket_name": "sn-gone-bucket",
        "log_group_names": ["/supernode/gone"],
        "node_group_names": ["gone-gpu"],
        "sns_topic_arn": "arn:aws:sns:us-east-1:123456789012:sn-gone",
    }
    checks = verify(dev, gone)
    assert checks["eks cluster"].detail == "cluster sn-gone not found in us-east-1"
    assert checks["eks nodegroup gone-gpu"].detail == "node group gone-gpu not found in cluster sn-gone"
    assert (
        checks["fsx state"].detail == checks["fsx throughput"].detail == "fs-0123456789abcdef0 not found in us-east-1"
    )
    for name in ("s3 lifecycle", "s3 encryption", "s3 public access block"):
        assert checks[name].detail == "bucket sn-gone-bucket not found"
    assert checks["log group /supernode/gone"].detail == "not found"
    assert checks["sns subscription"].detail == "topic arn:aws:sns:us-east-1:123456789012:sn-gone not found"
    assert [
        c for name, c in checks.items() if c.result != "fail" and name not in ("cloudwatch alarms", "eks nodegroups")
    ] == []


def test_bare_bucket_fails_each_bucket_check(moto_aws, dev, deployed):
    bare = moto_aws.unique("sn-bare")
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=bare)
    s3.delete_bucket_encryption(Bucket=bare)
    checks = verify(dev, deployed | {"bucket_name": bare})
    assert checks["s3 lifecycle"].detail == f"{bare} has no lifecycle configuration"
    assert checks["s3 encryption"].detail == f"{bare} has no default encryption"
    assert checks["s3 public access block"].detail == (
        f"{bare}: not set: BlockPublicAcls, IgnorePublicAcls, BlockPublicPolicy, RestrictPublicBuckets"
    )


def test_node_group_count_and_foreign_kms_key_fail(moto_aws, dev, deployed):
    outputs = deployed
    other = boto3.client("kms", region_name=REGION).create_key()["KeyMetadata"]["Arn"]
    checks = verify(dev, outputs | {"node_group_names": [], "kms_key_arns": {"data": other}})
    assert checks["eks nodegroups"].detail == "outputs list 0 accelerator node groups (none), config has 2"
    assert (
        checks["s3 encryption"].result == "fail"
        and f"not one of the stack's keys ({other})" in checks["s3 encryption"].detail
    )


def test_pending_email_subscription_warns(moto_aws, dev, deployed):
    outputs = deployed
    topic = outputs["sns_topic_arn"]
    moto_aws.answer(
        "ListSubscriptionsByTopic",
        moto_aws.Answer(
            body=f"""<?xml version="1.0"?>
<ListSubscriptionsByTopicResponse xmlns="http://sns.amazonaws.com/doc/2010-03-31/">
  <ListSubscriptionsByTopicResult><Subscriptions><member>
    <TopicArn>{topic}</TopicArn><Protocol>email</Protocol><SubscriptionArn>PendingConfirmation</SubscriptionArn>
    <Owner>123456789012</Owner><Endpoint>ml-oncall@example.com</Endpoint>
  </member></Subscriptions></ListSubscriptionsByTopicResult>
  <ResponseMetadata><RequestId>stub</RequestId></ResponseMetadata>
</ListSubscriptionsByTopicResponse>"""
        ),
    )
    check = verify(dev, outputs)["sns subscription"]
    assert check.result == "warn"
    assert check.fix == "confirm the subscription from the email sent to ml-oncall@example.com"


# -- errors: access denied, unreachable --------------------------------------------------------------


def test_access_denied_on_eks_and_the_other_checks_still_run(moto_aws, dev, deployed):
    outputs = deployed
    moto_aws.answer(
        f"GET /clusters/{outputs['cluster_name']}",
        moto_aws.json_error(
            "AccessDeniedException",
            "User: arn:aws:iam::123456789012:user/ci is not authorized to perform: eks:DescribeCluster",
            403,
        ),
    )
    checks = verify(dev, outputs)
    assert checks["eks cluster"].result == "fail"
    assert checks["eks cluster"].detail.startswith("access denied calling DescribeCluster (AccessDeniedException: ")
    assert checks["s3 encryption"].result == checks["cloudwatch alarms"].result == "pass"


def test_unreachable_endpoint_fails_every_check_without_a_traceback(
    moto_aws, dev, deployed, monkeypatch, tmp_path, capsys
):
    outputs = write(tmp_path, deployed)
    closed = moto_aws.closed_url()
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    assert main(["verify", "--stack", "dev", "--root", str(ROOT), "--outputs", str(outputs), "--json"]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    checks = json.loads(captured.out)["checks"]
    offline = [c for c in checks if c["name"] != "eks nodegroups"]  # that one only reads the outputs
    assert (
        offline
        and [c for c in offline if c["result"] != "fail" or c["detail"] != f"AWS endpoint unreachable: {closed}"] == []
    )


# -- command line: stable JSON, bad outputs files ------------------------------------------------------


def test_json_is_stable(moto_aws, dev, deployed, tmp_path, capsys):
    outputs = write(tmp_path, deployed)
    runs = []
    for _ in range(2):
        assert main(["verify", "--stack", "dev", "--root", str(ROOT), "--outputs", str(outputs), "--json"]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1]
    doc = json.loads(runs[0])
    assert sorted(doc) == ["checks", "command", "counts", "ok", "stack"]
    assert doc["command"] == "verify" and doc["ok"] is True
    assert doc["counts"] == {"fail": 0, "pass": 13, "warn": 1}  # FSx state: moto has no lifecycle
    names = [c["name"] for c in doc["checks"]]
    assert names == sorted(names)
    assert all(sorted(c) == ["detail", "fix", "name", "result"] for c in doc["checks"])


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "outputs file not found; write it with `pulumi stack output --json --show-secrets"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object of stack outputs, got list"),
        ({"contract_version": "1.0", "cluster_name": "x"}, "cluster_endpoint: required output is missing"),
        ("BAD_VERSION", "contract_version '2.0' is not compatible with 1.2"),
        ("BAD_TYPE", "node_group_names: Input should be a valid list (got 'gpu')"),
    ],
)
def test_bad_outputs_file_exits_2_with_a_clear_message(tmp_path, capsys, content, message):
    if content is None:
        path = tmp_path / "missing.json"
    elif content == "BAD_VERSION":
        path = write(tmp_path, OUTPUTS | {"contract_version": "2.0"})
    elif content == "BAD_TYPE":
        path = write(tmp_path, OUTPUTS | {"node_group_names": "gpu"})
    else:
        path = write(tmp_path, content)
    assert main(["verify", "--stack", "dev", "--root", str(ROOT), "--outputs", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_without_outputs_file_or_pulumi_cli_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no pulumi on PATH
    assert main(["verify", "--stack", "dev", "--root", str(ROOT)]) == 2
    assert "the pulumi CLI is not on PATH: pass --outputs FILE" in capsys.readouterr().err


# -- UltraServers: one NVLink domain per node group (DescribeInstanceTopology) ---------------------


def _ultraserver_instances(stub, group: str, count: int) -> list[str]:
    import boto3

    ec2 = boto3.client("ec2", region_name=REGION)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    run = ec2.run_instances(
        ImageId=image,
        MinCount=count,
        MaxCount=count,
        InstanceType="m5.large",
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "eks:nodegroup-name", "Value": group}]}],
    )
    return [i["InstanceId"] for i in run["Instances"]]


def _topology(stub, blocks: dict[str, str | None]) -> None:
    """moto lacks DescribeInstanceTopology: answer as EC2 does, one capacity block per instance."""
    items = "".join(
        f"<item><instanceId>{i}</instanceId><instanceType>p6e-gb200.36xlarge</instanceType>"
        + (f"<capacityBlockId>{b}</capacityBlockId>" if b else "")
        + "</item>"
        for i, b in blocks.items()
    )
    stub.answer(
        "DescribeInstanceTopology",
        stub.Answer(
            200,
            f'<DescribeInstanceTopologyResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
            f"<requestId>stub</requestId><instanceSet>{items}</instanceSet></DescribeInstanceTopologyResponse>",
        ),
    )


def test_ultraserver_group_in_one_nvlink_domain_passes_and_a_split_one_fails(moto_aws):
    from supernode.tools.verify import check_ultraserver

    group = moto_aws.unique("gb200")
    ids = _ultraserver_instances(moto_aws, group, 3)
    _topology(moto_aws, {i: "cb-0123456789abcdef0" for i in ids})
    check = check_ultraserver(Aws(REGION), group, 3, "u-p6e-gb200x36")
    assert check.result == "pass" and check.detail == "3 instances in one NVLink domain (cb-0123456789abcdef0)"
    _topology(moto_aws, {ids[0]: "cb-0123456789abcdef0", ids[1]: "cb-0fedcba9876543210", ids[2]: None})
    check = check_ultraserver(Aws(REGION), group, 4, "u-p6e-gb200x36")
    assert check.result == "fail"
    assert "3 instances running, the u-p6e-gb200x36 has 4" in check.detail
    assert "instances span 2 UltraServer(s)" in check.detail and "1 outside any" in check.detail


def test_ultraserver_check_without_the_api_warns(moto_aws):
    from supernode.tools.awscheck import Step, run_checks
    from supernode.tools.verify import check_ultraserver

    group = moto_aws.unique("gb200")
    _ultraserver_instances(moto_aws, group, 1)
    moto_aws.answer("DescribeInstanceTopology", moto_aws.ec2_error("InvalidAction", "not implemented"))
    [check] = run_checks(
        [
            Step(
                "ultraserver g",
                partial(check_ultraserver, Aws(REGION), group, 1, "u-p6e-gb200x36"),
                on_unsupported="warn",
                hint="by hand",
            )
        ]
    )
    assert check.result == "warn" and "cannot be checked" in check.detail
