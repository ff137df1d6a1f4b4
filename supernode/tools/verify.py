"""Verify: after `pulumi up`, the deployed resources are as the config and the plan say.

Reads the stack outputs (the contract in `supernode.core.contract.StackOutputs`, as
`pulumi stack output --json --show-secrets` prints them) and asks AWS about each resource.
`node_group_names` lists the accelerator node groups in the order of `acceleratorNodeGroups`.
"""

from __future__ import annotations

import json
import ssl
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError
from pydantic import ValidationError

from ..core.catalog import CATALOG, ULTRASERVERS
from ..core.config import Lifecycle, StackConfig
from ..core.contract import CONTRACT_VERSION, StackOutputs
from ..core.inference import InferencePlan
from ..core.plan import Plan
from .awscheck import Aws, Check, Step, error_code, failed, passed, run_checks, warned
from .serve import ServerFailed, complete, trust

PULUMI_UP = "run `pulumi up` to converge the stack"


class OutputsError(ValueError):
    """The outputs file is missing, not JSON, or does not follow the contract."""


def parse_outputs(text: str, source: str) -> StackOutputs:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise OutputsError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise OutputsError(f"{source}: expected a JSON object of stack outputs, got {type(data).__name__}")
    # The stack may export more than the contract (e.g. `plan`); only the contract is read.
    try:
        outs = StackOutputs.model_validate({k: v for k, v in data.items() if k in StackOutputs.model_fields})
    except ValidationError as e:
        problems = [
            f"  {'.'.join(map(str, err['loc']))}: "
            + ("required output is missing" if err["type"] == "missing" else f"{err['msg']} (got {err.get('input')!r})")
            for err in e.errors(include_url=False)
        ]
        raise OutputsError(
            f"{source}: does not follow the stack output contract {CONTRACT_VERSION}:\n" + "\n".join(problems)
        ) from None
    if outs.contract_version.split(".")[0] != CONTRACT_VERSION.split(".")[0]:
        raise OutputsError(
            f"{source}: contract_version {outs.contract_version!r} is not compatible with "
            f"{CONTRACT_VERSION} (major versions differ)"
        )
    return outs


def load_outputs(path: Path) -> StackOutputs:
    if not path.is_file():
        raise OutputsError(
            f"{path}: outputs file not found; write it with `pulumi stack output --json --show-secrets > {path}`"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OutputsError(f"{path}: cannot read ({e})") from None
    return parse_outputs(text, str(path))


def check_cluster(aws: Aws, name: str, version: str) -> Check:
    check = "eks cluster"
    try:
        c = aws.client("eks").describe_cluster(name=name)["cluster"]
    except ClientError as e:
        if error_code(e) != "ResourceNotFoundException":
            raise
        return failed(check, f"cluster {name} not found in {aws.region}", PULUMI_UP + " (or fix the outputs file)")
    problems = []
    if c.get("status") != "ACTIVE":
        problems.append(f"status {c.get('status')}, not ACTIVE")
    if c.get("version") != version:
        problems.append(f"Kubernetes {c.get('version')}, config says {version}")
    if problems:
        return failed(check, f"{name}: " + "; ".join(problems), PULUMI_UP)
    return passed(check, f"{name} ACTIVE at Kubernetes {version}")


def check_nodegroup(aws: Aws, cluster: str, name: str, instance_type: str, sizes: dict[str, int]) -> Check:
    """`sizes`: the scaling fields (minSize, desiredSize, maxSize) the config fixes."""
    check = f"eks nodegroup {name}"
    try:
        ng = aws.client("eks").describe_nodegroup(clusterName=cluster, nodegroupName=name)["nodegroup"]
    except ClientError as e:
        if error_code(e) != "ResourceNotFoundException":
            raise
        return failed(check, f"node group {name} not found in cluster {cluster}", PULUMI_UP)
    problems = []
    if ng.get("status") != "ACTIVE":
        problems.append(f"status {ng.get('status')}, not ACTIVE")
    if ng.get("instanceTypes") != [instance_type]:
        problems.append(f"instance types {ng.get('instanceTypes')}, expected [{instance_type}]")
    scaling = ng.get("scalingConfig", {})
    problems += [f"{k} {scaling.get(k)}, expected {v}" for k, v in sizes.items() if scaling.get(k) != v]
    if problems:
        return failed(check, "; ".join(problems), PULUMI_UP)
    return passed(check, f"ACTIVE, {instance_type}, " + ", ".join(f"{k} {v}" for k, v in sizes.items()))


def ultraserver_problems(
    topology: list[dict[str, Any]], node_names: Mapping[str, str], nodes: int, ultra_server: str
) -> list[str]:
    """What keeps a node group's instances (`node_names`' keys) from being one UltraServer, from EC2's
    DescribeInstanceTopology answer: its CapacityBlockId "identifies instances within the UltraServer
    domain" (EC2 API reference, InstanceTopology), so one id for all, and as many instances as the
    UltraServer has. Each UltraServer found names its nodes (`node_names`: instance id -> EC2 private DNS
    name, which EKS makes the Kubernetes node name), so a split group says which nodes sit where."""
    domain_of = {t["InstanceId"]: t.get("CapacityBlockId") for t in topology}
    by_domain: dict[str | None, list[str]] = defaultdict(list)
    for i in node_names:  # an instance the topology leaves out is in no UltraServer it can vouch for
        by_domain[domain_of.get(i)].append(i)

    def named(ids: list[str]) -> str:
        return ", ".join(f"{node_names.get(i) or '?'} ({i})" for i in sorted(ids))

    problems = []
    if len(node_names) != nodes:
        problems.append(f"{len(node_names)} instances running, the {ultra_server} has {nodes}")
    domains = sorted(d for d in by_domain if d is not None)
    if None in by_domain or len(domains) != 1:
        problems.append(
            f"instances span {len(domains)} UltraServer(s): "
            + "; ".join(f"{d}: {named(by_domain[d])}" for d in domains)
            + (f"; {len(by_domain[None])} outside any: {named(by_domain[None])}" if None in by_domain else "")
        )
    return problems


def check_ultraserver(aws: Aws, name: str, nodes: int, ultra_server: str) -> Check:
    """The node group's running instances are the instances of one UltraServer, one scale-up domain
    (NVLink on GB200, NeuronLink on Trn2): ultraserver_problems on EC2's instance topology."""
    check = f"ultraserver {name}"
    link = CATALOG[ULTRASERVERS[ultra_server].instance_type].link_name
    ec2 = aws.client("ec2")
    reservations = ec2.describe_instances(
        Filters=[
            {"Name": "tag:eks:nodegroup-name", "Values": [name]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
    )["Reservations"]
    node_names = {i["InstanceId"]: i.get("PrivateDnsName", "") for r in reservations for i in r["Instances"]}
    if not node_names:
        return failed(check, f"no running instances in node group {name}", PULUMI_UP + " and wait for the nodes")
    topology = ec2.describe_instance_topology(InstanceIds=sorted(node_names))["Instances"]
    problems = ultraserver_problems(topology, node_names, nodes, ultra_server)
    if problems:
        return failed(
            check,
            "; ".join(problems),
            "the group must be one UltraServer Capacity Block: check its reservation id and that no "
            "other capacity backs it",
        )
    return passed(check, f"{len(node_names)} instances in one {link} domain ({topology[0]['CapacityBlockId']})")


def check_nodegroup_count(names: list[str], expected: int) -> Check:
    check = "eks nodegroups"
    if len(names) != expected:
        return failed(
            check,
            f"outputs list {len(names)} accelerator node groups ({', '.join(names) or 'none'}), config has {expected}",
            PULUMI_UP,
        )
    return passed(check, f"{expected} accelerator node group(s) exported")


def describe_fsx(aws: Aws, fsx_id: str) -> dict[str, Any] | None:
    try:
        found = aws.client("fsx").describe_file_systems(FileSystemIds=[fsx_id])["FileSystems"]
    except ClientError as e:
        if error_code(e) != "FileSystemNotFound":
            raise
        return None
    return found[0] if found else None


def check_fsx_state(aws: Aws, fsx_id: str) -> Check:
    check = "fsx state"
    fs = describe_fsx(aws, fsx_id)
    if fs is None:
        return failed(check, f"{fsx_id} not found in {aws.region}", PULUMI_UP)
    state = fs.get("Lifecycle")
    if state is None:
        return warned(
            check,
            f"{fsx_id}: FSx did not report a lifecycle state, so AVAILABLE cannot be confirmed",
            f"aws fsx describe-file-systems --file-system-ids {fsx_id}",
        )
    if state != "AVAILABLE":
        return failed(
            check,
            f"{fsx_id} is {state}, not AVAILABLE",
            "wait for CREATING/UPDATING to finish; for FAILED/MISCONFIGURED see the FSx console",
        )
    return passed(check, f"{fsx_id} AVAILABLE")


def check_fsx_throughput(aws: Aws, fsx_id: str, plan: Plan, per_unit: int) -> Check:
    check = "fsx throughput"
    fs = describe_fsx(aws, fsx_id)
    if fs is None:
        return failed(check, f"{fsx_id} not found in {aws.region}", PULUMI_UP)
    lustre = fs.get("LustreConfiguration", {})
    capacity, unit = fs.get("StorageCapacity", 0), lustre.get("PerUnitStorageThroughput", 0)
    actual = capacity / 1024 * unit
    want = plan.checkpoint.fsx_throughput_mb_s
    detail = (
        f"{capacity} GiB x {unit} MB/s/TiB = {actual:.0f} MB/s; plan: {plan.checkpoint.fsx_capacity_gib} GiB x "
        f"{per_unit} = {want:.0f} MB/s"
    )
    if lustre.get("DeploymentType") != "PERSISTENT_2":
        return failed(
            check, f"deployment type {lustre.get('DeploymentType')}, expected PERSISTENT_2; {detail}", PULUMI_UP
        )
    if actual + 0.5 < want:
        return failed(
            check,
            f"below plan: {detail}",
            PULUMI_UP + f" (a checkpoint write would exceed its {plan.checkpoint.write_budget_s} s budget)",
        )
    return passed(check, detail)


def _rule_prefix(rule: dict[str, Any]) -> str | None:
    f = rule.get("Filter", {})
    return f.get("Prefix", f.get("And", {}).get("Prefix", rule.get("Prefix")))


def _bucket_setting(check: str, bucket: str, fetch: Callable[[], Any], absent_code: str) -> tuple[Any, Check | None]:
    """One S3 bucket setting: (value, None); (None, None) when the setting is absent; (None, a failing
    Check) when the bucket itself is missing. Other errors go to the runner's per-check handling."""
    try:
        return fetch(), None
    except ClientError as e:
        if error_code(e) == "NoSuchBucket":
            return None, failed(check, f"bucket {bucket} not found", PULUMI_UP)
        if error_code(e) == absent_code:
            return None, None
        raise


def check_lifecycle(aws: Aws, bucket: str, lc: Lifecycle, checkpoint_prefix: str, log_prefix: str) -> Check:
    check = "s3 lifecycle"
    rules, missing = _bucket_setting(
        check,
        bucket,
        lambda: aws.client("s3").get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"],
        "NoSuchLifecycleConfiguration",
    )
    if missing:
        return missing
    if rules is None:
        return failed(check, f"{bucket} has no lifecycle configuration", PULUMI_UP)
    enabled = [r for r in rules if r.get("Status") == "Enabled"]
    ckpt = [r for r in enabled if _rule_prefix(r) == checkpoint_prefix]
    logs = [r for r in enabled if _rule_prefix(r) == log_prefix]
    found = {
        "checkpoint transition days": {t.get("Days") for r in ckpt for t in r.get("Transitions", [])},
        "checkpoint expiry days": {r.get("Expiration", {}).get("Days") for r in ckpt},
        "log expiry days": {r.get("Expiration", {}).get("Days") for r in logs},
        "noncurrent expiry days": {r.get("NoncurrentVersionExpiration", {}).get("NoncurrentDays") for r in enabled},
        "abort multipart days": {
            r.get("AbortIncompleteMultipartUpload", {}).get("DaysAfterInitiation") for r in enabled
        },
    }
    wanted = {
        "checkpoint transition days": lc.checkpoint_transition_days,
        "checkpoint expiry days": lc.checkpoint_expire_days,
        "log expiry days": lc.log_expire_days,
        "noncurrent expiry days": lc.noncurrent_expire_days,
        "abort multipart days": lc.abort_multipart_days,
    }
    wrong = [
        f"{k}: expected {v}, found {sorted(x for x in found[k] if x is not None) or 'none'}"
        for k, v in wanted.items()
        if v not in found[k]
    ]
    if wrong:
        return failed(check, f"{bucket} ({checkpoint_prefix}, {log_prefix}): " + "; ".join(wrong), PULUMI_UP)
    return passed(check, f"{bucket}: " + ", ".join(f"{k} {v}" for k, v in wanted.items()))


def check_encryption(aws: Aws, bucket: str, key_arns: list[str]) -> Check:
    check = "s3 encryption"
    rules, missing = _bucket_setting(
        check,
        bucket,
        lambda: aws.client("s3").get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"],
        "ServerSideEncryptionConfigurationNotFoundError",
    )
    if missing:
        return missing
    if rules is None:
        return failed(check, f"{bucket} has no default encryption", PULUMI_UP)
    sse = rules[0]["ApplyServerSideEncryptionByDefault"]
    algo, key = sse.get("SSEAlgorithm"), sse.get("KMSMasterKeyID")
    if not str(algo).startswith("aws:kms"):
        return failed(check, f"{bucket} uses {algo}, expected SSE-KMS (aws:kms)", PULUMI_UP)
    if key_arns and key not in key_arns and not any(a.endswith(f"/{key}") for a in key_arns):
        return failed(
            check, f"{bucket} uses KMS key {key}, not one of the stack's keys ({', '.join(key_arns)})", PULUMI_UP
        )
    return passed(check, f"{bucket}: {algo} with {key}")


PUBLIC_ACCESS_FLAGS = ("BlockPublicAcls", "IgnorePublicAcls", "BlockPublicPolicy", "RestrictPublicBuckets")


def check_public_access(aws: Aws, bucket: str) -> Check:
    check = "s3 public access block"
    pab, missing = _bucket_setting(
        check,
        bucket,
        lambda: aws.client("s3").get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"],
        "NoSuchPublicAccessBlockConfiguration",
    )
    if missing:
        return missing
    pab = pab or {}
    off = [f for f in PUBLIC_ACCESS_FLAGS if not pab.get(f)]
    if off:
        return failed(check, f"{bucket}: not set: {', '.join(off)}", PULUMI_UP)
    return passed(check, f"{bucket}: all four public-access blocks on")


def check_alarms(aws: Aws, names: list[str]) -> Check:
    check = "cloudwatch alarms"
    if not names:
        return failed(check, "the stack exports no alarms", PULUMI_UP)
    pages = (
        aws.client("cloudwatch")
        .get_paginator("describe_alarms")
        .paginate(AlarmNames=names, AlarmTypes=["MetricAlarm", "CompositeAlarm"])
    )
    found = {a["AlarmName"] for page in pages for a in page.get("MetricAlarms", []) + page.get("CompositeAlarms", [])}
    missing = [n for n in names if n not in found]
    if missing:
        return failed(check, f"{len(missing)} of {len(names)} missing: {', '.join(missing)}", PULUMI_UP)
    return passed(check, f"all {len(names)} exist")


def check_log_group(aws: Aws, name: str, retention: int) -> Check:
    check = f"log group {name}"
    pages = aws.client("logs").get_paginator("describe_log_groups").paginate(logGroupNamePrefix=name)
    group = next((g for page in pages for g in page["logGroups"] if g["logGroupName"] == name), None)
    if group is None:
        return failed(check, "not found", PULUMI_UP)
    days = group.get("retentionInDays")
    if days != retention:
        have = f"retention {days} days" if days else "no retention (kept forever)"
        return failed(check, f"{have}; monitoring.logRetentionDays is {retention}", PULUMI_UP)
    return passed(check, f"retention {days} days")


def check_subscription(aws: Aws, topic_arn: str, email: str) -> Check:
    check = "sns subscription"
    try:
        pages = aws.client("sns").get_paginator("list_subscriptions_by_topic").paginate(TopicArn=topic_arn)
        subs = [s for page in pages for s in page["Subscriptions"]]
    except ClientError as e:
        if error_code(e) != "NotFound":
            raise
        return failed(check, f"topic {topic_arn} not found", PULUMI_UP)
    if not subs:
        return failed(check, f"{topic_arn} has no subscription, so alarms reach nobody", PULUMI_UP)
    listed = ", ".join(sorted(f"{s['Protocol']}:{s['Endpoint']}" for s in subs))
    if all(s.get("SubscriptionArn") == "PendingConfirmation" for s in subs):
        return warned(
            check, f"only pending subscriptions: {listed}", f"confirm the subscription from the email sent to {email}"
        )
    return passed(check, listed)


@dataclass(frozen=True)
class ServingProbe:
    """One request through the serving service: `url` is where the client reaches it (in an allowed
    namespace https://<app>.<namespace>.svc:8000; from outside, a `kubectl port-forward` to a name the
    certificate holds), `ca_pem` the `serving_ca` stack output (None: plain HTTP or a public CA),
    `api_key` the `serving_api_key` one."""

    url: str
    model: str  # the served model name (the serving workload's app name)
    prompt: str = "The capital of France is"
    expect: str | None = None  # text the answer must contain; None: any non-empty answer
    max_tokens: int = 16
    api_key: str | None = None
    ca_pem: str | None = None
    timeout_s: float = 60.0


SERVING_FIX = "check the serving pods (`kubectl -n NAMESPACE get pods`), the URL and the serving_ca / serving_api_key"


def _latency_misses(name: str, measured_ms: float, target_ms: float | None, estimate_ms: float) -> list[str]:
    if target_ms is None or measured_ms <= target_ms:
        return []
    return [f"{name} {measured_ms:.0f} ms over the {target_ms:g} ms target (the plan estimates {estimate_ms:.0f} ms)"]


def check_serving(probe: ServingProbe, ip: InferencePlan) -> Check:
    """A streamed completion: it must answer (HTTP 200, tokens, `expect` in its text), and its TTFT and
    ITL must be within inference.ttftTargetMs / itlTargetMs. One short request on a server otherwise
    idle is the best case the p99 targets are for, so over a target here the SLO is missed for sure;
    within it says nothing of the p99 under load (the ttft/itl alarms watch that)."""
    check = "serving request"
    if probe.ca_pem is not None or probe.api_key is not None:
        try:
            trust(probe.url, probe.ca_pem, probe.api_key)
        except (ssl.SSLError, ValueError) as e:
            return failed(check, f"the serving CA is not a PEM certificate ({e})", "pass the serving_ca stack output")
    try:
        done = complete(probe.url, probe.prompt, probe.max_tokens, probe.model, timeout=probe.timeout_s)
    except ServerFailed as e:
        refused = "HTTP 401" in str(e)
        return failed(
            check,
            f"{probe.url}: {'the API key was refused: ' if refused else ''}{e}",
            "pass the serving_api_key stack output" if refused else SERVING_FIX,
        )
    except (OSError, ValueError) as e:  # refused, unresolved, TLS verification, timeout, not the API's JSON
        return failed(check, f"{probe.url}: {type(e).__name__}: {e}", SERVING_FIX)
    ttft_ms, itl_ms = done.ttft_s * 1e3, done.itl_s * 1e3
    figures = f"{done.tokens} tokens, TTFT {ttft_ms:.0f} ms, ITL {itl_ms:.1f} ms"
    if done.tokens < 1 or not done.text.strip() or (probe.expect is not None and probe.expect not in done.text):
        wanted = f"an answer containing {probe.expect!r}" if probe.expect is not None else "a non-empty answer"
        return failed(check, f"{probe.url}: expected {wanted}, got {done.text!r} ({figures})", SERVING_FIX)
    misses = _latency_misses("TTFT", ttft_ms, ip.ttft_target_ms, ip.ttft_ms) + _latency_misses(
        "ITL", itl_ms, ip.itl_target_ms, ip.itl_ms
    )
    if misses:
        return failed(
            check,
            f"{probe.url}: " + "; ".join(misses) + f" ({figures})",
            "the server is slower than the plan: see its ttft/itl alarms and `supernode plan` (inference)",
        )
    targets = ", ".join(
        f"{n} target {t:g} ms" for n, t in (("TTFT", ip.ttft_target_ms), ("ITL", ip.itl_target_ms)) if t is not None
    )
    return passed(check, f"{figures}; answer {done.text.strip()[:40]!r}" + (f"; within {targets}" if targets else ""))


def verify_steps(
    cfg: StackConfig, plan: Plan, outs: StackOutputs, aws: Aws, serving: ServingProbe | None = None
) -> list[Step]:
    cluster = outs.cluster_name
    steps = [
        Step("eks cluster", partial(check_cluster, aws, cluster, cfg.cluster.kubernetes_version)),
        Step("eks nodegroups", partial(check_nodegroup_count, outs.node_group_names, len(cfg.accelerator_node_groups))),
    ]
    for name, g in zip(outs.node_group_names, cfg.accelerator_node_groups):
        steps.append(
            Step(
                f"eks nodegroup {name}",
                partial(check_nodegroup, aws, cluster, name, g.instance_type, {"desiredSize": g.instances}),
            )
        )
        if g.ultra_server:
            steps.append(
                Step(
                    f"ultraserver {name}",
                    partial(check_ultraserver, aws, name, g.nodes, g.ultra_server),
                    on_unsupported="warn",
                    hint="`aws ec2 describe-instance-topology` lists each instance's capacityBlockId",
                )
            )
    sng = cfg.system_node_group
    steps.append(
        Step(
            f"eks nodegroup {outs.system_node_group_name}",
            partial(
                check_nodegroup,
                aws,
                cluster,
                outs.system_node_group_name,
                sng.instance_type,
                {"minSize": sng.min_size, "desiredSize": sng.desired_size, "maxSize": sng.max_size},
            ),
        )
    )
    steps += [
        Step("fsx state", partial(check_fsx_state, aws, outs.fsx_id)),
        Step(
            "fsx throughput", partial(check_fsx_throughput, aws, outs.fsx_id, plan, cfg.storage.fsx.per_unit_throughput)
        ),
    ]
    st = cfg.storage
    keys = sorted(set(outs.kms_key_arns.values()) | ({cfg.identity.kms_key_arn} if cfg.identity.kms_key_arn else set()))
    steps += [
        Step(
            "s3 lifecycle",
            partial(check_lifecycle, aws, outs.bucket_name, st.lifecycle, outs.checkpoint_prefix, st.log_prefix),
        ),
        Step("s3 encryption", partial(check_encryption, aws, outs.bucket_name, keys)),
        Step("s3 public access block", partial(check_public_access, aws, outs.bucket_name)),
        Step("cloudwatch alarms", partial(check_alarms, aws, outs.alarm_names)),
    ]
    steps += [
        Step(f"log group {n}", partial(check_log_group, aws, n, cfg.monitoring.log_retention_days))
        for n in outs.log_group_names
    ]
    steps.append(
        Step(
            "sns subscription", partial(check_subscription, aws, outs.sns_topic_arn, cfg.monitoring.notification_email)
        )
    )
    if serving is not None and plan.inference is not None:
        steps.append(Step("serving request", partial(check_serving, serving, plan.inference)))
    return steps


def run_verify(
    cfg: StackConfig, plan: Plan, outs: StackOutputs, aws: Aws | None = None, serving: ServingProbe | None = None
) -> list[Check]:
    return run_checks(verify_steps(cfg, plan, outs, aws or Aws(cfg.region), serving))
