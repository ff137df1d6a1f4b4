"""Offline preview: call the Pulumi program (components/program.py) in-process under Pulumi's mock
engine (docs/architecture.md §3).

Pulumi's `MockMonitor` stands in for the engine and the cloud. `RecordingMonitor` keeps every
registration (URN, type, name, parent, inputs, dependencies) — that list *is* the preview — and
`CloudMocks` returns plausible computed state and answers provider invokes from the catalog.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pulumi
from pulumi.runtime import mocks as pmocks
from pulumi.runtime import settings as psettings
from pulumi.runtime.config import set_all_config
from pulumi.runtime.stack import run_pulumi_func

from ..core import resource_types as T
from ..core.catalog import CATALOG
from ..core.config import NAMESPACE, StackConfig
from ..core.plan import PLAN_CONFIGMAP_KEY, Plan, build_plan

# A Pulumi program: declares the stack's resources (and exports its outputs) from its config and plan.
Program = Callable[[str, StackConfig, Plan], None]
ACCOUNT = "123456789012"
DYNAMIC = "pulumi-python:dynamic:Resource"  # a Pulumi dynamic resource: its provider runs only under the engine


@dataclass
class Resource:
    urn: str
    type: str
    name: str
    parent: str
    inputs: dict[str, Any]
    dependencies: list[str] = field(default_factory=list)
    custom: bool = True
    id: str = ""
    outputs: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "urn": self.urn,
            "type": self.type,
            "name": self.name,
            "parent": self.parent,
            "inputs": self.inputs,
            "dependencies": self.dependencies,
            "custom": self.custom,
        }


# How the engine protocol marks a secret value: {SIG: SECRET, "value": ...} (pulumi.runtime.rpc).
_SECRET_SIG, _SECRET_VALUE = "4dabf18193072939515e22adb298388d", "1b47061264138c4ac30d75fd1eb44270"


def _plain(value: Any) -> Any:
    """Engine values as JSON: unknowns become None, resource references their URN, a secret its value."""
    if isinstance(value, dict) and value.get(_SECRET_SIG) == _SECRET_VALUE:
        return _plain(value.get("value"))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, pulumi.Resource):
        return getattr(value, "_urn_str", None)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class CloudMocks(pmocks.Mocks):
    """Computed state for new resources; invokes answered from the catalog."""

    def __init__(self, region: str, stack_outputs: dict[str, dict[str, Any]] | None = None):
        self.region = region
        # Outputs of other stacks, by fully qualified name, for `pulumi.StackReference` reads.
        self.stack_outputs = stack_outputs or {}

    def new_resource(self, args: pmocks.MockResourceArgs):
        typ, name = args.typ, args.name
        if typ == T.STACK_REFERENCE:
            stack = args.inputs.get("name") or args.resource_id or name
            return stack, {"name": stack, "outputs": self.stack_outputs.get(stack, {}), "secretOutputNames": []}
        digest = hashlib.sha1(f"{typ}/{name}".encode()).hexdigest()
        prefix = _ID_PREFIX.get(typ)
        rid = f"{prefix}-{digest[:17]}" if prefix else f"{name}-{digest[:8]}"
        if typ == T.BUCKET and args.inputs.get("bucket"):
            rid = args.inputs["bucket"]  # a bucket's id is its name
        service = typ.split(":")[1].split("/")[0] if typ.startswith("aws:") else ""
        state = dict(args.inputs)
        state.setdefault(
            "arn", f"arn:aws:{service or 'mock'}:{self.region}:{ACCOUNT}:{typ.rsplit(':', 1)[-1].lower()}/{rid}"
        )
        state.setdefault("name", args.inputs.get("name", rid))
        state.update(_computed(typ, rid, args.inputs, self.region))
        return rid, state

    def call(self, args: pmocks.MockCallArgs):
        token, a = args.token, args.args
        if token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            from .catalog import REGION_AZS

            names = [self.region + s for s in REGION_AZS.get(self.region, ("a", "b", "c"))]
            return {"names": names, "zoneIds": [f"use1-az{i + 1}" for i in range(len(names))], "id": self.region}
        if token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"accountId": ACCOUNT, "arn": f"arn:aws:iam::{ACCOUNT}:user/ci", "userId": "AIDAMOCK", "id": ACCOUNT}
        if token == "aws:index/getPartition:getPartition":
            return {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws"}
        if token in ("aws:index/getRegion:getRegion",):
            return {
                "name": self.region,
                "region": self.region,
                "id": self.region,
                "endpoint": f"ec2.{self.region}.amazonaws.com",
            }
        if token == "aws:ec2/getInstanceType:getInstanceType":
            t = CATALOG[a["instanceType"]]
            return {
                "instanceType": t.name,
                "defaultVcpus": t.vcpus,
                "memorySize": t.memory_gib * 1024,
                "maximumNetworkCards": t.efa_interfaces,
                "efaSupported": True,
                "maximumEfaInterfaces": t.efa_interfaces,
                "gpuses": [
                    {"count": t.accelerators, "manufacturer": "NVIDIA", "name": t.accelerator, "memorySize": t.hbm_mib}
                ],
                "id": t.name,
            }
        if token == "aws:ssm/getParameter:getParameter":
            return {"name": a["name"], "value": "ami-0abc1234def567890", "type": "String", "id": a["name"]}
        return {}


# EC2-style ids, so outputs look like what AWS returns (vpc-0123…, sg-…, fs-…).
_ID_PREFIX = {
    T.VPC: "vpc",
    T.SUBNET: "subnet",
    T.SECURITY_GROUP: "sg",
    T.ROUTE_TABLE: "rtb",
    T.INTERNET_GATEWAY: "igw",
    T.NAT_GATEWAY: "nat",
    T.EIP: "eipalloc",
    T.VPC_ENDPOINT: "vpce",
    T.LAUNCH_TEMPLATE: "lt",
    T.FLOW_LOG: "fl",
    T.SG_INGRESS: "sgr",
    T.SG_EGRESS: "sgr",
    T.FSX_LUSTRE: "fs",
    T.FSX_DRA: "dra",
}


def _computed(typ: str, rid: str, inputs: dict, region: str) -> dict[str, Any]:
    """Plausible computed outputs so dependent resources resolve."""
    name = inputs.get("name") or rid
    if typ == DYNAMIC and "dns_names" in inputs:  # components/k8s/credentials.py: generated at create only
        return {k: f"<{k} generated at create>" for k in ("ca_pem", "cert_pem", "key_pem", "api_key")}
    if typ == T.EKS_CLUSTER:
        return {
            "endpoint": f"https://{rid}.gr7.{region}.eks.amazonaws.com",
            "certificateAuthority": {"data": "bW9jay1jYQ=="},
            "identities": [{"oidcs": [{"issuer": f"https://oidc.eks.{region}.amazonaws.com/id/{rid.upper()}"}]}],
            "status": "ACTIVE",
            "version": inputs.get("version"),
            "vpcConfig": {**inputs.get("vpcConfig", {}), "clusterSecurityGroupId": f"sg-{rid[-8:]}c1"},
        }
    if typ == T.FSX_LUSTRE:
        return {"dnsName": f"{rid}.fsx.{region}.amazonaws.com", "mountName": rid[-8:]}
    if typ == T.KMS_KEY:
        key_id = str(uuid.UUID(hashlib.md5(rid.encode()).hexdigest()))
        return {"keyId": key_id, "arn": f"arn:aws:kms:{region}:{ACCOUNT}:key/{key_id}"}
    if typ == T.BUCKET:
        bucket = inputs.get("bucket") or rid
        return {
            "bucket": bucket,
            "arn": f"arn:aws:s3:::{bucket}",
            "bucketRegionalDomainName": f"{bucket}.s3.{region}.amazonaws.com",
        }
    if typ == T.LAUNCH_TEMPLATE:
        return {"latestVersion": 1}
    if typ in (T.IAM_ROLE, T.IAM_POLICY):
        return {"arn": f"arn:aws:iam::{ACCOUNT}:{typ.rsplit(':', 1)[-1].lower()}/{name}", "name": name}
    if typ == T.IAM_OIDC_PROVIDER:
        return {"arn": f"arn:aws:iam::{ACCOUNT}:oidc-provider/{str(inputs.get('url', rid)).removeprefix('https://')}"}
    if typ == T.LOG_GROUP:
        return {"arn": f"arn:aws:logs:{region}:{ACCOUNT}:log-group:{name}"}
    if typ == T.SNS_TOPIC:
        return {"arn": f"arn:aws:sns:{region}:{ACCOUNT}:{name}"}
    if typ == T.ECR_REPOSITORY:
        return {"repositoryUrl": f"{ACCOUNT}.dkr.ecr.{region}.amazonaws.com/{name}"}
    if typ == T.NODE_GROUP:
        ng = inputs.get("nodeGroupName") or rid  # EKS names the group's Auto Scaling group eks-<name>-<uuid>
        return {
            "status": "ACTIVE",
            "nodeGroupName": ng,
            "resources": [
                {"autoscalingGroups": [{"name": f"eks-{ng}-{uuid.UUID(hashlib.md5(rid.encode()).hexdigest())}"}]}
            ],
        }
    return {}


class RecordingMonitor(pmocks.MockMonitor):
    """Pulumi's MockMonitor, keeping each registration with its parent and dependencies."""

    def __init__(self, mocks: pmocks.Mocks):
        super().__init__(mocks)
        self.recorded: list[Resource] = []

    def RegisterResource(self, request):
        response = super().RegisterResource(request)
        if request.type != T.STACK:
            reg = self.resources.get(response.urn)
            inputs = pulumi.runtime.rpc.deserialize_properties(request.object)
            self.recorded.append(
                Resource(
                    urn=response.urn,
                    type=request.type,
                    name=request.name,
                    parent=request.parent,
                    inputs=_plain(inputs),
                    dependencies=sorted(set(request.dependencies)),
                    custom=request.custom,
                    id=response.id,
                    outputs=_plain(reg.state) if reg else {},
                )
            )
        return response


@dataclass
class PreviewResult:
    stack: str
    resources: list[Resource]
    outputs: dict[str, Any]
    secret_outputs: list[str] = field(default_factory=list)  # exported as secrets (`pulumi up` masks them)

    def by_type(self, typ: str) -> list[Resource]:
        return [r for r in self.resources if r.type == typ]

    def plan(self) -> Plan:
        """The Plan the program deployed: the plan ConfigMap's JSON, as the job and the policies read it."""
        for r in self.resources:
            data = r.inputs.get("data") if r.inputs.get("kind") == "ConfigMap" else None
            if isinstance(data, dict) and isinstance(data.get(PLAN_CONFIGMAP_KEY), str):
                return Plan.from_json(data[PLAN_CONFIGMAP_KEY])
        raise LookupError(f"the program deployed no ConfigMap with data['{PLAN_CONFIGMAP_KEY}']")


def config_for_engine(stack: str, cfg: StackConfig) -> dict[str, str]:
    """What `pulumi up` hands the program: structured values as JSON, strings as they are."""
    out = {"aws:region": cfg.region}
    for key, value in cfg.to_mapping().items():
        out[f"{NAMESPACE}:{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


def run_program(stack: str, cfg: StackConfig, program: Program | None = None) -> PreviewResult:
    """Run a Pulumi program (by default the stack's, supernode.components.program.program) under the mock engine
    and return every registered resource."""
    if program is None:
        # Here, not at the top: the AWS and Kubernetes SDKs take a second to import, which every other
        # `supernode` command would pay.
        from supernode.components.program import program
    psettings.reset_options()
    psettings.set_root_resource(None)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    set_all_config(config_for_engine(stack, cfg))
    mocks = CloudMocks(cfg.region)
    monitor = RecordingMonitor(mocks)
    pmocks.set_mocks(mocks, project="supernode", stack=stack, preview=False, monitor=monitor)
    outputs: dict[str, Any] = {}
    secret_outputs: list[str] = []

    async def program_run() -> None:
        program(stack, cfg, build_plan(stack, cfg))
        root = psettings.get_root_resource()
        exported = getattr(root, "outputs", {})
        exports = [pulumi.Output.from_input(v) for v in exported.values()]
        values = await asyncio.gather(*(o.future() for o in exports))
        outputs.update({k: _plain(v) for k, v in zip(exported, values)})
        secret = await asyncio.gather(*(o.is_secret() for o in exports))
        secret_outputs.extend(k for k, s in zip(exported, secret) if s)

    try:
        loop.run_until_complete(run_pulumi_func(program_run))
    finally:
        loop.close()
        asyncio.set_event_loop(None)
    return PreviewResult(
        stack=stack, resources=_tree_order(monitor.recorded), outputs=outputs, secret_outputs=secret_outputs
    )


def _tree_order(resources: list[Resource]) -> list[Resource]:
    """Parents before children, siblings by URN: the SDK registers from a thread pool, so the
    arrival order varies from run to run while the tree does not."""
    children: dict[str, list[Resource]] = {}
    urns = {r.urn for r in resources}
    for r in resources:
        children.setdefault(r.parent if r.parent in urns else "", []).append(r)
    ordered: list[Resource] = []
    stack = sorted(children.get("", []), key=lambda r: r.urn, reverse=True)
    while stack:
        r = stack.pop()
        ordered.append(r)
        stack.extend(sorted(children.get(r.urn, []), key=lambda c: c.urn, reverse=True))
    return ordered
