"""StackConfig: one validated description of an environment.

Read from the `supernode:` namespace of `Pulumi.<stack>.yaml` (what `pulumi config set --path`
writes) or from Pulumi's runtime config inside `__main__.py`; both go through `from_mapping`, so
there is one schema. Keys are camelCase as in Pulumi config; every error names its YAML path
(`supernode:parallel.tp`), the bad value and what would be valid.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic.alias_generators import to_camel

from .catalog import CATALOG, EKS_ADDON_VERSIONS, REGION_AZS, SYSTEM_INSTANCE_TYPES

NAMESPACE = "supernode"
DIGEST_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
CW_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192,
                     2557, 2922, 3288, 3653)
FSX_PER_UNIT_THROUGHPUT = (125, 250, 500, 1000)  # MB/s per TiB, PERSISTENT_2


class Issue(BaseModel):
    path: str
    value: Any = None
    message: str
    missing: bool = False  # no value was given at all

    def __str__(self) -> str:
        got = "" if self.missing else f" (got {self.value!r})"
        return f"{self.path}: {self.message}{got}"


class ConfigError(Exception):
    """Every problem in a stack file at once; the CLI prints them and exits 2."""

    def __init__(self, issues: list[Issue], source: str = ""):
        self.issues = issues
        self.source = source
        super().__init__("\n".join(str(i) for i in issues))


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True,
                              frozen=True, strict=False)


class Cluster(_Base):
    kubernetes_version: str = Field(pattern=r"^1\.(2[89]|3[0-9])$")
    endpoint_private_access: bool = True
    endpoint_public_access: bool = False
    public_access_cidrs: list[str] = []


SubnetId = Annotated[str, Field(pattern=r"^subnet-[0-9a-f]{8,17}$")]


class Network(_Base):
    """A VPC the stack creates (the *Cidrs keys), or an existing one (existingVpcId and the
    existing*SubnetId(s) keys). vpcCidr is required either way: security-group rules use it, and
    preflight compares it with the existing VPC's."""

    vpc_cidr: str
    availability_zones: list[str] = Field(min_length=2, description="AZs of the private subnets")
    private_subnet_cidrs: list[str] = []  # required unless existingVpcId (infra_rules)
    public_subnet_cidrs: list[str] = []
    gpu_subnet_cidr: Optional[str] = None  # required unless existingVpcId (infra_rules)
    nat_gateway: Optional[bool] = None  # default: on for a VPC the stack creates, off in an existing one
    flow_logs: bool = True
    existing_vpc_id: Optional[str] = Field(default=None, pattern=r"^vpc-[0-9a-f]{8,17}$")
    existing_private_subnet_ids: list[SubnetId] = Field(default=[], description="one per availabilityZones entry")
    existing_gpu_subnet_id: Optional[SubnetId] = Field(default=None, description="in the GPU availabilityZone")

    @property
    def use_nat_gateway(self) -> bool:
        return self.nat_gateway if self.nat_gateway is not None else self.existing_vpc_id is None


class Capacity(_Base):
    type: Literal["on-demand", "capacity-reservation", "capacity-block"] = "on-demand"
    reservation_id: Optional[str] = Field(default=None, pattern=r"^cr-[0-9a-f]{8,17}$")
    availability_zone: Optional[str] = None


class AcceleratorNodeGroup(_Base):
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,30}$")
    instance_type: str
    nodes: int = Field(ge=1, le=512)
    capacity: Capacity = Capacity()
    ami_release_version: str = Field(pattern=r"^1\.\d+\.\d+-\d{8}$")
    placement_group: Optional[bool] = None  # default: on, unless a reservation is targeted
    require_efa: bool = True

    @field_validator("instance_type")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in CATALOG:
            raise ValueError(f"instance type is not in the accelerator catalog; valid: {', '.join(CATALOG)}")
        return v

    @property
    def use_placement_group(self) -> bool:
        if self.placement_group is not None:
            return self.placement_group
        return self.capacity.type == "on-demand"


class SystemNodeGroup(_Base):
    instance_type: str = "m6i.xlarge"
    min_size: int = Field(default=2, ge=1)
    desired_size: int = Field(default=2, ge=1)
    max_size: int = Field(default=4, ge=1)

    @field_validator("instance_type")
    @classmethod
    def _allowed(cls, v: str) -> str:
        if v not in SYSTEM_INSTANCE_TYPES:
            raise ValueError(f"not an approved system instance type; valid: {', '.join(SYSTEM_INSTANCE_TYPES)}")
        return v


class Lifecycle(_Base):
    checkpoint_transition_days: int = Field(default=14, ge=1)
    checkpoint_expire_days: int = Field(default=90, ge=1)
    noncurrent_expire_days: int = Field(default=7, ge=1)
    log_expire_days: int = Field(default=30, ge=1)
    abort_multipart_days: int = Field(default=3, ge=1, le=30)


class Fsx(_Base):
    deployment_type: Literal["PERSISTENT_2"] = "PERSISTENT_2"
    capacity_gib: Optional[int] = Field(default=None, description="None: sized by the planner")
    per_unit_throughput: int = 250
    checkpoint_write_budget_s: int = Field(default=300, ge=10)

    @field_validator("capacity_gib")
    @classmethod
    def _fsx_capacity(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and not (v == 1200 or (v >= 2400 and v % 2400 == 0)):
            raise ValueError("FSx for Lustre PERSISTENT_2 accepts 1200 GiB or a multiple of 2400 GiB")
        return v

    @field_validator("per_unit_throughput")
    @classmethod
    def _fsx_throughput(cls, v: int) -> int:
        if v not in FSX_PER_UNIT_THROUGHPUT:
            raise ValueError(f"PERSISTENT_2 per-unit throughput must be one of {FSX_PER_UNIT_THROUGHPUT} MB/s/TiB")
        return v


class Storage(_Base):
    bucket_name: Optional[str] = Field(default=None, pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
    existing_bucket: bool = False
    dataset_prefix: str = Field(default="datasets/", pattern=r"^[A-Za-z0-9._/-]+/$")
    checkpoint_prefix: str = Field(default="checkpoints/", pattern=r"^[A-Za-z0-9._/-]+/$")
    log_prefix: str = Field(default="logs/", pattern=r"^[A-Za-z0-9._/-]+/$")
    lifecycle: Lifecycle = Lifecycle()
    fsx: Fsx = Fsx()


class Identity(_Base):
    kms_key_arn: Optional[str] = Field(default=None, pattern=r"^arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:key/[0-9a-f-]{36}$")
    kms_key_rotation: bool = True
    pod_identity: Literal["irsa", "pod-identity"] = "irsa"


class Monitoring(_Base):
    log_retention_days: int = 30
    gpu_util_floor_percent: float = Field(default=40.0, gt=0, le=100)
    gpu_util_window_minutes: int = Field(default=30, ge=5, le=1440)
    notification_email: str = Field(pattern=r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$")
    fsx_free_capacity_floor_percent: float = Field(default=10.0, gt=0, lt=100)

    @field_validator("log_retention_days")
    @classmethod
    def _retention(cls, v: int) -> int:
        if v not in CW_RETENTION_DAYS:
            raise ValueError(f"CloudWatch accepts retention of {', '.join(map(str, CW_RETENTION_DAYS))} days")
        return v


class Images(_Base):
    trainer: str
    fabric_check: Optional[str] = None  # default: the trainer image (it carries trainer.fabric)

    @field_validator("trainer", "fabric_check")
    @classmethod
    def _digest(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not DIGEST_RE.match(v):
            raise ValueError("image must be pinned by digest: REPOSITORY@sha256:<64 hex digits>")
        return v


class Model(_Base):
    layers: int = Field(ge=1)
    dim: int = Field(ge=8)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    shared_experts: int = Field(default=0, ge=0)
    expert_hidden: int = Field(ge=1)
    dense_hidden: int = Field(ge=1)
    moe_every: int = Field(default=1, ge=1, description="every n-th layer is MoE; 1: all")
    first_dense_layers: int = Field(default=0, ge=0)
    vocab: int = Field(ge=2)
    seq_len: int = Field(ge=2)
    router: Literal["softmax", "sigmoid"] = "softmax"
    load_balance_coef: float = Field(default=0.0, ge=0)
    z_loss_coef: float = Field(default=0.0, ge=0)
    bias_update_rate: float = Field(default=1e-3, ge=0, description="aux-loss-free expert bias step")
    rope_theta: float = Field(default=10000.0, gt=0)
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_dense_layers and (layer - self.first_dense_layers) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.layers))


class Parallel(_Base):
    dp_replicate: int = Field(default=1, ge=1)
    dp_shard: int = Field(default=1, ge=1)
    tp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    overlap: bool = True
    mixed_precision: Literal["bf16", "fp32"] = "bf16"

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


class Training(_Base):
    global_batch: int = Field(ge=1, description="sequences per optimizer step")
    micro_batch: int = Field(ge=1)
    steps: int = Field(ge=1)
    lr: float = Field(gt=0, le=1)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(default=0.1, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    checkpoint_interval: int = Field(ge=1)
    keep_checkpoints: int = Field(default=3, ge=1)
    async_checkpoint: bool = True
    collective_timeout_s: int = Field(default=600, ge=10)
    max_restarts: int = Field(default=3, ge=0)
    seed: int = 0
    weights_uri: Optional[str] = None
    weights_sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class Workload(_Base):
    namespace: str = Field(default="training", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    service_account: str = Field(default="trainer", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    gate_min_fraction: float = Field(default=0.8, gt=0, le=1.5,
                                     description="interconnect gate: fraction of the catalog baseline")
    termination_grace_s: int = Field(default=900, ge=30)
    hugepages_2mi_gib: int = Field(default=5, ge=0)


def _partial(model: type[_Base]) -> type[_Base]:
    """The same fields, all optional: used by `local` to override parts of the plan."""
    fields = {name: (Optional[f.annotation], None) for name, f in model.model_fields.items()}
    return create_model(f"{model.__name__}Override", __base__=_Base, **fields)


ModelOverride = _partial(Model)
ParallelOverride = _partial(Parallel)
TrainingOverride = _partial(Training)


class Local(_Base):
    """Scales the same plan down for a CPU run (gloo): world size = nproc."""

    nproc: int = Field(default=2, ge=1, le=16)
    model: ModelOverride = ModelOverride()  # type: ignore[valid-type]
    parallel: ParallelOverride = ParallelOverride()  # type: ignore[valid-type]
    training: TrainingOverride = TrainingOverride()  # type: ignore[valid-type]


class StackConfig(_Base):
    region: str = Field(pattern=r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
    availability_zone: str
    cluster: Cluster
    network: Network
    accelerator_node_groups: list[AcceleratorNodeGroup] = Field(min_length=1)
    system_node_group: SystemNodeGroup = SystemNodeGroup()
    storage: Storage = Storage()
    identity: Identity = Identity()
    monitoring: Monitoring
    images: Images
    model: Model
    parallel: Parallel = Parallel()
    training: Training
    workload: Workload = Workload()
    local: Local = Local()

    # -- derived ---------------------------------------------------------------------------
    @property
    def accelerators(self) -> int:
        return sum(g.nodes * CATALOG[g.instance_type].accelerators for g in self.accelerator_node_groups)

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.accelerator_node_groups)

    def to_mapping(self) -> dict[str, Any]:
        """The `supernode:` keys as Pulumi config holds them (camelCase, defaults included)."""
        return self.model_dump(by_alias=True, mode="json")

    def local_config(self) -> "StackConfig":
        """This stack with the `local` overrides applied; the layout then has world size nproc."""
        data = self.model_dump(by_alias=False)
        for section in ("model", "parallel", "training"):
            data[section].update(getattr(self.local, section).model_dump(exclude_none=True))
        return StackConfig.model_validate(data)


# -- rules across fields ---------------------------------------------------------------------

P = f"{NAMESPACE}:"


def _nets(paths_cidrs: list[tuple[str, str]], issues: list[Issue]) -> list[tuple[str, ipaddress.IPv4Network]]:
    nets = []
    for path, cidr in paths_cidrs:
        try:
            nets.append((path, ipaddress.IPv4Network(cidr, strict=True)))
        except ValueError as e:
            issues.append(Issue(path=path, value=cidr, message=f"not a valid IPv4 CIDR ({e}); e.g. 10.0.0.0/16"))
    return nets


def _created_vpc_rules(c: StackConfig, vpc: Optional[ipaddress.IPv4Network]) -> list[Issue]:
    """The stack creates the VPC: its subnets come from the *Cidrs keys, inside vpcCidr, disjoint."""
    net, issues = c.network, []
    azs = len(net.availability_zones)
    for key, value in (("existingPrivateSubnetIds", net.existing_private_subnet_ids),
                       ("existingGpuSubnetId", net.existing_gpu_subnet_id)):
        if value:
            issues.append(Issue(path=f"{P}network.{key}", value=value,
                                message="existing subnets need network.existingVpcId (their VPC); set it, "
                                        "or remove this key to let the stack create the subnets"))
    if not net.private_subnet_cidrs:
        issues.append(Issue(path=P + "network.privateSubnetCidrs", value=net.private_subnet_cidrs,
                            missing="private_subnet_cidrs" not in net.model_fields_set,
                            message=f"required unless network.existingVpcId is set: one CIDR inside vpcCidr "
                                    f"per availability zone ({azs})"))
    elif len(net.private_subnet_cidrs) != azs:
        issues.append(Issue(path=P + "network.privateSubnetCidrs", value=net.private_subnet_cidrs,
                            message=f"need one private subnet per availability zone ({azs})"))
    if net.gpu_subnet_cidr is None:
        issues.append(Issue(path=P + "network.gpuSubnetCidr", missing=True,
                            message="required unless network.existingVpcId is set: a CIDR inside vpcCidr for "
                                    "the GPU nodes' subnet in availabilityZone"))
    if net.public_subnet_cidrs and len(net.public_subnet_cidrs) != azs:
        issues.append(Issue(path=P + "network.publicSubnetCidrs", value=net.public_subnet_cidrs,
                            message=f"need none or one public subnet per availability zone ({azs})"))
    if net.use_nat_gateway and not net.public_subnet_cidrs:
        issues.append(Issue(path=P + "network.natGateway", value=True,
                            message="a NAT gateway needs public subnets; set publicSubnetCidrs or natGateway: false"))

    subnets = _nets(
        [(f"{P}network.privateSubnetCidrs[{i}]", s) for i, s in enumerate(net.private_subnet_cidrs)]
        + [(f"{P}network.publicSubnetCidrs[{i}]", s) for i, s in enumerate(net.public_subnet_cidrs)]
        + ([(P + "network.gpuSubnetCidr", net.gpu_subnet_cidr)] if net.gpu_subnet_cidr is not None else []), issues)
    if vpc:
        for path, subnet in subnets:
            if not subnet.subnet_of(vpc):
                issues.append(Issue(path=path, value=str(subnet), message=f"subnet is outside the VPC CIDR {vpc}"))
    for i, (pa, a) in enumerate(subnets):
        for pb, b in subnets[i + 1:]:
            if a.overlaps(b):
                issues.append(Issue(path=pb, value=str(b), message=f"subnet overlaps {pa} ({a}); subnets must not overlap"))
    return issues


def _existing_vpc_rules(c: StackConfig) -> list[Issue]:
    """Bring your own VPC: subnets are named by id; routing, egress and endpoints are the VPC owner's."""
    net, issues = c.network, []
    for key, value in (("privateSubnetCidrs", net.private_subnet_cidrs), ("publicSubnetCidrs", net.public_subnet_cidrs),
                       ("gpuSubnetCidr", net.gpu_subnet_cidr)):
        if value:
            issues.append(Issue(path=f"{P}network.{key}", value=value,
                                message="ambiguous with network.existingVpcId: the stack creates no subnets in an "
                                        "existing VPC; remove it and name the subnets in existingPrivateSubnetIds / "
                                        "existingGpuSubnetId"))
    ids, azs = net.existing_private_subnet_ids, net.availability_zones
    if len(ids) != len(azs):
        issues.append(Issue(path=P + "network.existingPrivateSubnetIds", value=ids,
                            message=f"need one subnet id (subnet-...) per availability zone, in the same order "
                                    f"({', '.join(azs)})"))
    elif len(set(ids)) != len(ids):
        issues.append(Issue(path=P + "network.existingPrivateSubnetIds", value=ids,
                            message="subnet ids must be distinct: a subnet lies in one availability zone"))
    if net.existing_gpu_subnet_id is None:
        issues.append(Issue(path=P + "network.existingGpuSubnetId", missing=True,
                            message=f"required with network.existingVpcId: the id (subnet-...) of the GPU nodes' "
                                    f"subnet in availabilityZone {c.availability_zone}"))
    if net.nat_gateway:  # only an explicit true: the default is off in an existing VPC
        issues.append(Issue(path=P + "network.natGateway", value=True,
                            message="must be false with network.existingVpcId: the VPC owner provides egress "
                                    "(NAT, endpoints) in an existing VPC; set natGateway: false"))
    return issues


def infra_rules(c: StackConfig) -> list[Issue]:
    """Region, AZ, network and node-group rules (everything but the parallel layout)."""
    issues: list[Issue] = []
    region_azs = REGION_AZS.get(c.region)
    valid_azs = [c.region + s for s in region_azs] if region_azs else None

    def check_az(path: str, az: str) -> None:
        if not az.startswith(c.region) or (valid_azs is not None and az not in valid_azs):
            hint = ", ".join(valid_azs) if valid_azs else f"{c.region}<letter>"
            issues.append(Issue(path=path, value=az, message=f"availability zone is not in region {c.region}; valid: {hint}"))

    check_az(P + "availabilityZone", c.availability_zone)
    for i, az in enumerate(c.network.availability_zones):
        check_az(f"{P}network.availabilityZones[{i}]", az)
    if len(set(c.network.availability_zones)) != len(c.network.availability_zones):
        issues.append(Issue(path=P + "network.availabilityZones", value=c.network.availability_zones,
                            message="availability zones must be distinct"))
    vpc = _nets([(P + "network.vpcCidr", c.network.vpc_cidr)], issues)
    if c.network.existing_vpc_id:
        issues += _existing_vpc_rules(c)
    else:
        issues += _created_vpc_rules(c, vpc[0][1] if vpc else None)

    for i, cidr in enumerate(c.cluster.public_access_cidrs):
        _nets([(f"{P}cluster.publicAccessCidrs[{i}]", cidr)], issues)
    if c.cluster.endpoint_public_access and not c.cluster.public_access_cidrs:
        issues.append(Issue(path=P + "cluster.publicAccessCidrs", value=[],
                            message="a public endpoint needs allowed CIDRs (an empty list means 0.0.0.0/0)"))
    if not c.cluster.endpoint_private_access and not c.cluster.endpoint_public_access:
        issues.append(Issue(path=P + "cluster.endpointPrivateAccess", value=False,
                            message="at least one of endpointPrivateAccess / endpointPublicAccess must be true"))

    names = [g.name for g in c.accelerator_node_groups]
    amis = {g.ami_release_version for g in c.accelerator_node_groups}
    for i, g in enumerate(c.accelerator_node_groups):
        gp = f"{P}acceleratorNodeGroups[{i}]"
        if names.count(g.name) > 1:
            issues.append(Issue(path=gp + ".name", value=g.name, message="node group names must be unique"))
        if not g.ami_release_version.startswith(c.cluster.kubernetes_version + "."):
            issues.append(Issue(path=gp + ".amiReleaseVersion", value=g.ami_release_version,
                                message=f"AMI release must match the cluster's Kubernetes {c.cluster.kubernetes_version} "
                                        f"(e.g. {c.cluster.kubernetes_version}.0-20251120)"))
        if len(amis) > 1:
            issues.append(Issue(path=gp + ".amiReleaseVersion", value=g.ami_release_version,
                                message=f"all accelerator node groups must pin the same AMI release; found {sorted(amis)}"))
        if g.require_efa and CATALOG[g.instance_type].efa_interfaces == 0:
            issues.append(Issue(path=gp + ".instanceType", value=g.instance_type, message="instance type has no EFA"))
        cap = g.capacity
        if cap.type != "on-demand" and not cap.reservation_id:
            issues.append(Issue(path=gp + ".capacity.reservationId", value=None,
                                message=f"capacity type {cap.type} needs a reservation id (cr-...)"))
        if cap.type == "on-demand" and cap.reservation_id:
            issues.append(Issue(path=gp + ".capacity.type", value=cap.type,
                                message="a reservation id is set: use capacity-reservation or capacity-block"))
        if cap.availability_zone and cap.availability_zone != c.availability_zone:
            issues.append(Issue(path=gp + ".capacity.availabilityZone", value=cap.availability_zone,
                                message=f"the reservation's AZ must be the GPU subnet's AZ {c.availability_zone}"))
        if cap.type == "capacity-block" and g.placement_group:
            issues.append(Issue(path=gp + ".placementGroup", value=True,
                                message="Capacity Blocks are already co-located and conflict with a placement group; set false"))
    sng = c.system_node_group
    if not sng.min_size <= sng.desired_size <= sng.max_size:
        issues.append(Issue(path=P + "systemNodeGroup.desiredSize", value=sng.desired_size,
                            message=f"need minSize <= desiredSize <= maxSize ({sng.min_size}..{sng.max_size})"))
    lc = c.storage.lifecycle
    if lc.checkpoint_expire_days <= lc.checkpoint_transition_days:
        issues.append(Issue(path=P + "storage.lifecycle.checkpointExpireDays", value=lc.checkpoint_expire_days,
                            message=f"must be greater than checkpointTransitionDays ({lc.checkpoint_transition_days})"))
    if c.storage.existing_bucket and not c.storage.bucket_name:
        issues.append(Issue(path=P + "storage.bucketName", value=None, message="existingBucket needs a bucketName"))
    if c.cluster.kubernetes_version not in EKS_ADDON_VERSIONS:
        issues.append(Issue(path=P + "cluster.kubernetesVersion", value=c.cluster.kubernetes_version,
                            message=f"no pinned EKS add-on versions for it; supported: {', '.join(EKS_ADDON_VERSIONS)}"))
    return issues


def layout_rules(m: Model, p: Parallel, t: Training, world_size: int, max_tp: int, prefix: str = P,
                 world_source: str = "") -> list[Issue]:
    """The parallel layout against the model and the hardware: shared by the stack and `local`."""
    issues: list[Issue] = []
    mp, pp_, tp_ = prefix + "model.", prefix + "parallel.", prefix + "training."
    if m.dim % m.heads:
        issues.append(Issue(path=mp + "dim", value=m.dim, message=f"dim must be divisible by heads ({m.heads})"))
    elif m.head_dim % 2:
        issues.append(Issue(path=mp + "dim", value=m.dim, message="head dim (dim/heads) must be even for RoPE"))
    if m.heads % m.kv_heads:
        issues.append(Issue(path=mp + "kvHeads", value=m.kv_heads, message=f"heads ({m.heads}) must be a multiple of kvHeads"))
    if m.top_k > m.experts:
        issues.append(Issue(path=mp + "topK", value=m.top_k, message=f"topK must be at most experts ({m.experts})"))
    if m.first_dense_layers > m.layers:
        issues.append(Issue(path=mp + "firstDenseLayers", value=m.first_dense_layers, message=f"at most layers ({m.layers})"))
    if p.world_size != world_size:
        issues.append(Issue(path=pp_ + "dpShard", value=p.dp_shard,
                            message=f"dpReplicate*dpShard*tp*pp = {p.dp_replicate}*{p.dp_shard}*{p.tp}*{p.pp} = "
                                    f"{p.world_size}, but the world size is {world_size}{world_source}; "
                                    f"dpShard = {world_size / (p.dp_replicate * p.tp * p.pp):g} would match"))
    if p.tp > max_tp:
        issues.append(Issue(path=pp_ + "tp", value=p.tp, message=f"tensor parallel must stay inside a node (<= {max_tp})"))
    for name, n in (("heads", m.heads), ("kvHeads", m.kv_heads)):
        if n % p.tp:
            issues.append(Issue(path=pp_ + "tp", value=p.tp, message=f"tp must divide model.{name} ({n})"))
    if m.experts % p.ep:
        issues.append(Issue(path=pp_ + "ep", value=p.ep, message=f"ep must divide model.experts ({m.experts})"))
    if (p.dp_shard * p.tp) % p.ep:
        issues.append(Issue(path=pp_ + "ep", value=p.ep,
                            message=f"ep must divide dpShard*tp ({p.dp_shard}*{p.tp} = {p.dp_shard * p.tp})"))
    if m.layers % p.pp:
        issues.append(Issue(path=pp_ + "pp", value=p.pp, message=f"pp must divide model.layers ({m.layers})"))
    elif p.pp > 1:
        # The planner models pipeline stages, but the trainer has no pipeline schedule yet: a plan the
        # job cannot run must not provision hardware.
        issues.append(Issue(path=pp_ + "pp", value=p.pp,
                            message="pipeline parallel is not supported by the trainer yet; use pp: 1 and "
                                    "shard with dpShard/ep/tp instead"))
    per_step = t.micro_batch * p.dp
    if t.global_batch % per_step:
        issues.append(Issue(path=tp_ + "globalBatch", value=t.global_batch,
                            message=f"must be divisible by microBatch*dp = {t.micro_batch}*{p.dp} = {per_step}; "
                                    f"e.g. {max(per_step, t.global_batch // per_step * per_step)}"))
    if t.warmup_steps >= t.steps and t.steps > 1:
        issues.append(Issue(path=tp_ + "warmupSteps", value=t.warmup_steps, message=f"must be below steps ({t.steps})"))
    return issues


def rules(c: StackConfig) -> list[Issue]:
    max_tp = min(CATALOG[g.instance_type].accelerators for g in c.accelerator_node_groups)
    issues = infra_rules(c)
    issues += layout_rules(c.model, c.parallel, c.training, c.accelerators, max_tp,
                           world_source=" (sum of nodes x accelerators per node)")
    # The local section must yield a valid CPU layout too.
    try:
        local = c.local_config()
    except ValidationError as e:
        issues += _issues(e, P + "local.", c.model_dump(by_alias=True, mode="json"))
    else:
        issues += layout_rules(local.model, local.parallel, local.training, c.local.nproc, c.local.nproc,
                               prefix=P + "local.", world_source=" (local.nproc)")
    return issues


# -- loading ---------------------------------------------------------------------------------

def _value_at(data: Any, loc: tuple) -> Any:
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _path(prefix: str, loc: tuple) -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("" if out.endswith((":", ".")) else ".") + str(part)
    return out


def _issues(err: ValidationError, prefix: str, data: Any) -> list[Issue]:
    out = []
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if p not in ("function-after", "function-plain"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (typo?); remove it or use a documented key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] == "string_type" and isinstance(e.get("input"), (int, float)):
            msg += f'; quote it in YAML: "{e["input"]}"'
        missing = e["type"] == "missing"
        value = None if missing else e.get("input")
        out.append(Issue(path=_path(prefix, loc), value=value if value is not None else _value_at(data, loc),
                         message=msg, missing=missing))
    return out


def from_mapping(data: Any, source: str = "") -> StackConfig:
    """Validate the `supernode:` keys (without the namespace) and the cross-field rules."""
    if not isinstance(data, dict):
        raise ConfigError([Issue(path=P.rstrip(":"), value=data, message="expected a mapping of supernode:* keys")], source)
    try:
        cfg = StackConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_issues(e, P, data), source) from None
    problems = rules(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def read_stack_file(path: Path) -> dict[str, Any]:
    """The `supernode:` keys of a Pulumi.<stack>.yaml, namespace stripped; other namespaces checked lightly."""
    src = str(path)
    if not path.is_file():
        stacks = sorted(f.name for f in path.parent.glob("Pulumi.*.yaml")) if path.parent.is_dir() else []
        hint = f"; found: {', '.join(stacks)}" if stacks else ""
        raise ConfigError([Issue(path=src, message=f"stack file not found{hint}", missing=True)], src)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError([Issue(path=src, value=None, message=f"not valid YAML: {e}".replace("\n", " "))], src) from None
    if doc is None:
        raise ConfigError([Issue(path=src, value=None, message="file is empty; expected a top-level 'config:' mapping")], src)
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        raise ConfigError([Issue(path="config", value=doc if not isinstance(doc, dict) else doc.get("config"),
                                 message="expected a top-level 'config:' mapping of namespace:key entries")], src)
    issues, data = [], {}
    for key, value in doc["config"].items():
        if not isinstance(key, str) or ":" not in key:
            issues.append(Issue(path=f"config.{key}", value=value, message="config keys are namespace:key, e.g. supernode:region"))
            continue
        ns, name = key.split(":", 1)
        if ns == NAMESPACE:
            data[name] = value
    region = doc["config"].get("aws:region")
    if region is not None and data.get("region") not in (None, region):
        issues.append(Issue(path="aws:region", value=region, message=f"must equal supernode:region ({data.get('region')})"))
    try:
        cfg_issues: list[Issue] = []
        from_mapping(data, src)
    except ConfigError as e:
        cfg_issues = e.issues
    if issues or cfg_issues:
        raise ConfigError(issues + cfg_issues, src)
    return data


def load_stack(stack: str, root: Path = Path(".")) -> StackConfig:
    path = Path(root) / f"Pulumi.{stack}.yaml"
    return from_mapping(read_stack_file(path), str(path))


def load_file(path: Path) -> StackConfig:
    return from_mapping(read_stack_file(Path(path)), str(path))
