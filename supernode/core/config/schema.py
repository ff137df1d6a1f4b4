"""The stack's configuration schema: one pydantic model per section of the `supernode:` namespace.

Keys are camelCase as in Pulumi config (`pulumi config set --path`). Field-level rules live here;
rules across fields are in `rules`, reading files in `loading`.
"""

from __future__ import annotations

import difflib
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
)
from pydantic.alias_generators import to_camel

from ..catalog import CATALOG, SYSTEM_INSTANCE_TYPES, ULTRASERVERS, nvlink_domain_gpus
from ..errors import Issue
from ..mesh import Mesh
from ..runs import NEW, RUN_ID
from ..teams import NAME as TEAM_NAME

NAMESPACE = "supernode"
DIGEST_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
CW_RETENTION_DAYS = (
    1,
    3,
    5,
    7,
    14,
    30,
    60,
    90,
    120,
    150,
    180,
    365,
    400,
    545,
    731,
    1096,
    1827,
    2192,
    2557,
    2922,
    3288,
    3653,
)
FSX_PER_UNIT_THROUGHPUT = (125, 250, 500, 1000)  # MB/s per TiB, PERSISTENT_2


def when_unset(meaning: str) -> dict[str, str]:
    """An optional key's json_schema_extra: what the stack does when the key is left out (its default
    depends on other keys), which docs/configuration.md prints as the key's default."""
    return {"unset": meaning}


class _Base(BaseModel):
    # Strict: `nodes: true` or `nodes: "2"` is an error naming the key, not a silent 1 or 2 (YAML and
    # JSON give every value its type already; a float field still takes an integer).
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True, strict=True)


class ClusterConfig(_Base):
    kubernetes_version: str = Field(
        pattern=r"^1\.(2[89]|3[0-9])$",
        description="EKS Kubernetes version (1.MINOR); the catalog pins each version's add-ons",
    )
    endpoint_private_access: bool = Field(
        default=True, description="the API server is reachable from inside the VPC (the nodes use it)"
    )
    endpoint_public_access: bool = Field(
        default=False, description="the API server is reachable from the internet, from publicAccessCidrs only"
    )
    public_access_cidrs: list[str] = Field(
        default=[], description="CIDRs allowed to the public endpoint; at least one when endpointPublicAccess is true"
    )


SubnetId = Annotated[str, Field(pattern=r"^subnet-[0-9a-f]{8,17}$")]


class NetworkConfig(_Base):
    """A VPC the stack creates (the *Cidrs keys), or an existing one (existingVpcId and the
    existing*SubnetId(s) keys). vpcCidr is required either way: security-group rules use it, and
    preflight compares it with the existing VPC's."""

    vpc_cidr: str = Field(
        description="the VPC's IPv4 CIDR (of the VPC created, or of existingVpcId's, which preflight compares)"
    )
    availability_zones: list[str] = Field(min_length=2, description="AZs of the private subnets")
    private_subnet_cidrs: list[str] = Field(
        default=[],
        description="created VPC: one private subnet CIDR per availabilityZones entry, same order, inside vpcCidr",
    )
    public_subnet_cidrs: list[str] = Field(
        default=[],
        description="created VPC: none, or one public subnet CIDR per availabilityZones entry (where the NAT "
        "gateway lives)",
    )
    gpu_subnet_cidr: str | None = Field(
        default=None,
        description="created VPC: the GPU nodes' subnet, in availabilityZone, inside vpcCidr",
        json_schema_extra=when_unset(
            "required for a VPC the stack creates; none with existingVpcId (existingGpuSubnetId instead)"
        ),
    )
    nat_gateway: bool | None = Field(
        default=None,
        description="a NAT gateway (in the public subnets) for the private subnets' egress",
        json_schema_extra=when_unset(
            "on for a VPC the stack creates (needs publicSubnetCidrs); off with existingVpcId"
        ),
    )
    flow_logs: bool = Field(default=True, description="VPC flow logs to CloudWatch Logs")
    existing_vpc_id: str | None = Field(
        default=None,
        pattern=r"^vpc-[0-9a-f]{8,17}$",
        description="an existing VPC to deploy into, instead of creating one: name its subnets in "
        "existingPrivateSubnetIds / existingGpuSubnetId",
        json_schema_extra=when_unset("the stack creates the VPC from the *Cidrs keys"),
    )
    existing_private_subnet_ids: list[SubnetId] = Field(default=[], description="one per availabilityZones entry")
    existing_gpu_subnet_id: SubnetId | None = Field(
        default=None,
        description="in the GPU availabilityZone",
        json_schema_extra=when_unset(
            "required with existingVpcId; none when the stack creates the VPC (gpuSubnetCidr)"
        ),
    )

    @property
    def use_nat_gateway(self) -> bool:
        return self.nat_gateway if self.nat_gateway is not None else self.existing_vpc_id is None


# Capacity Blocks: EC2 terminates the instances from 30 min before the end; EKS wants the node group at 0
# by 40 min before (docs/hardware.md "Buying and placing").
CAPACITY_BLOCK_DRAIN = timedelta(minutes=40)


class Capacity(_Base):
    type: Literal["on-demand", "capacity-reservation", "capacity-block"] = Field(
        default="on-demand",
        description="how the GPU instances are bought: on-demand, a targeted On-Demand Capacity Reservation, or a "
        "Capacity Block",
    )
    reservation_id: str | None = Field(
        default=None,
        pattern=r"^cr-[0-9a-f]{8,17}$",
        description="the capacity reservation or Capacity Block the group targets (capacity-reservation and "
        "capacity-block only)",
        json_schema_extra=when_unset("none: on-demand capacity"),
    )
    availability_zone: str | None = Field(
        default=None,
        description="the reservation's AZ, if given: must equal availabilityZone (a reservation serves one AZ)",
        json_schema_extra=when_unset("availabilityZone"),
    )
    ends_at: AwareDatetime | None = Field(
        default=None,
        strict=False,  # an ISO string in the stack file (and in Pulumi's runtime config) is the way to write it
        description="capacity-block only, required there: the block's end (EC2's EndDate) as an ISO "
        "date-time with its offset, e.g. 2026-03-14T11:30:00Z. The node group is scaled to 0 forty minutes before "
        "(EC2 terminates the instances from 30 minutes before); preflight compares it with EC2",
        json_schema_extra=when_unset("none: capacity types other than capacity-block have no end"),
    )

    @property
    def scale_to_zero_at(self) -> datetime | None:
        """When a capacity-block node group goes to 0 nodes (UTC): EKS's guide says 40 minutes before
        the block's end, 10 before EC2 starts terminating its instances, so pods are drained (the
        trainer checkpoints on SIGTERM) instead of killed."""
        return None if self.ends_at is None else (self.ends_at - CAPACITY_BLOCK_DRAIN).astimezone(UTC)


class AcceleratorNodeGroup(_Base):
    name: str = Field(
        pattern=r"^[a-z][a-z0-9-]{0,30}$",
        description="node group name (unique): its nodes' label and its resources' names",
    )
    instance_type: str = Field(
        description="GPU instance type, from the accelerator catalog (supernode/core/catalog.py), whose figures "
        "size the plan"
    )
    nodes: int = Field(
        ge=1,
        le=512,
        description="instances in the group (fixed size: the trainer's world is nodes x accelerators per node)",
    )
    spares: int = Field(
        default=0,
        ge=0,
        le=64,
        description="training groups only: instances kept beyond `nodes`, booted and health-checked like the "
        "others but outside the world, so a failed node is replaced at once (the Auto Scaling group holds "
        "nodes + spares; the plan's cost counts them; a reservation must hold them too)",
    )
    capacity: Capacity = Field(
        default=Capacity(), description="how the instances are bought (on-demand, reservation, Capacity Block)"
    )
    ami_release_version: str = Field(
        pattern=r"^1\.\d+\.\d+-\d{8}$",
        description="the EKS-optimised accelerated AMI release (VERSION-YYYYMMDD), the same in every group, of "
        "cluster.kubernetesVersion",
    )
    placement_group: bool | None = Field(
        default=None,
        description="a cluster placement group for the nodes (lowest EFA latency)",
        json_schema_extra=when_unset(
            "on for on-demand capacity; off for a capacity reservation or Capacity Block (their placement is EC2's)"
        ),
    )
    require_efa: bool = Field(default=True, description="the nodes get EFA interfaces; the instance type must have EFA")
    role: Literal["training", "serving"] = Field(
        default="training",
        description="training: the group's accelerators are the training job's world; serving: they are "
        "serving's reserved share of the pool (Kueue quota of its own, outside the world), so serving's "
        "replicasMin never evicts training (docs/architecture.md, how training and serving share the accelerators)",
    )
    ultra_server: str | None = Field(
        default=None,
        description="the UltraServer this group is (e.g. "
        "u-p6e-gb200x72): its instances form one NVLink domain, bought as one "
        "Capacity Block (capacity.reservationId)",
        json_schema_extra=when_unset(
            "none: the group is separate instances (required for a type sold only in UltraServers)"
        ),
    )

    @field_validator("instance_type")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in CATALOG:
            close = difflib.get_close_matches(v, list(CATALOG), n=3, cutoff=0.6)
            listed = (
                f"did you mean {' or '.join(repr(c) for c in close)}?"
                if close
                else f"the catalog (supernode/core/catalog.py) holds {', '.join(CATALOG)}"
            )
            raise ValueError(f"instance type is not in the accelerator catalog; {listed}")
        return v

    @field_validator("ultra_server")
    @classmethod
    def _ultra_server(cls, v: str | None) -> str | None:
        if v is not None and v not in ULTRASERVERS:
            raise ValueError(f"not a known UltraServer type; valid: {', '.join(ULTRASERVERS)}")
        return v

    @property
    def instances(self) -> int:
        """Instances the group runs: its nodes and its spares."""
        return self.nodes + self.spares

    @property
    def nvlink_domain(self) -> int:
        """GPUs in one NVLink domain of this group: its UltraServer's, else one node's."""
        return nvlink_domain_gpus(self.instance_type, self.ultra_server)

    @property
    def use_placement_group(self) -> bool:
        if self.placement_group is not None:
            return self.placement_group
        return self.capacity.type == "on-demand"


class SystemNodeGroup(_Base):
    instance_type: str = Field(
        default="m6i.xlarge",
        description="instance type of the system nodes (add-ons, controllers), from an approved list",
    )
    min_size: int = Field(default=2, ge=1, description="the node group's minimum size")
    desired_size: int = Field(default=2, ge=1, description="the node group's size at creation")
    max_size: int = Field(default=4, ge=1, description="the node group's maximum size")

    @field_validator("instance_type")
    @classmethod
    def _allowed(cls, v: str) -> str:
        if v not in SYSTEM_INSTANCE_TYPES:
            raise ValueError(f"not an approved system instance type; valid: {', '.join(SYSTEM_INSTANCE_TYPES)}")
        return v


class Lifecycle(_Base):
    checkpoint_transition_days: int = Field(
        default=14, ge=1, description="checkpoint objects in S3 move to Glacier Instant Retrieval after this many days"
    )
    checkpoint_expire_days: int = Field(
        default=90,
        ge=1,
        description="checkpoint objects tagged `window` (not milestones) expire after this many days; greater than "
        "checkpointTransitionDays",
    )
    checkpoint_milestone_every: int = Field(
        default=10,
        ge=1,
        le=10**6,
        description="every k-th checkpoint of a run (by step: step / training.checkpointInterval a multiple "
        "of k), and each run's newest, is a milestone that S3 keeps after checkpointExpireDays "
        "(`supernode checkpoints --retain` tags them; the lifecycle rules expire only the rest)",
    )
    noncurrent_expire_days: int = Field(
        default=7, ge=1, description="overwritten or deleted object versions are kept this many days"
    )
    log_expire_days: int = Field(default=30, ge=1, description="objects under logPrefix expire after this many days")
    abort_multipart_days: int = Field(
        default=3, ge=1, le=30, description="incomplete multipart uploads are aborted after this many days"
    )


class FsxConfig(_Base):
    deployment_type: Literal["PERSISTENT_2"] = Field(
        default="PERSISTENT_2", description="FSx for Lustre deployment type (only PERSISTENT_2)"
    )
    capacity_gib: int | None = Field(
        default=None,
        description="FSx for Lustre capacity in GiB",
        json_schema_extra=when_unset(
            "sized by the planner: the smallest that writes a checkpoint within checkpointWriteBudgetS and holds "
            "training.keepCheckpoints + 1 checkpoints"
        ),
    )
    per_unit_throughput: int = Field(default=250, description="FSx throughput in MB/s per TiB of capacity")
    checkpoint_write_budget_s: int = Field(
        default=300,
        ge=10,
        description="seconds a checkpoint write may take at FSx's throughput: the planner sizes capacity and the "
        "checkpoint policy checks against it",
    )

    @field_validator("capacity_gib")
    @classmethod
    def _fsx_capacity(cls, v: int | None) -> int | None:
        if v is not None and not (v == 1200 or (v >= 2400 and v % 2400 == 0)):
            raise ValueError("FSx for Lustre PERSISTENT_2 accepts 1200 GiB or a multiple of 2400 GiB")
        return v

    @field_validator("per_unit_throughput")
    @classmethod
    def _fsx_throughput(cls, v: int) -> int:
        if v not in FSX_PER_UNIT_THROUGHPUT:
            raise ValueError(f"PERSISTENT_2 per-unit throughput must be one of {FSX_PER_UNIT_THROUGHPUT} MB/s/TiB")
        return v


class StorageConfig(_Base):
    bucket_name: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
        description="the S3 bucket for datasets, checkpoints and logs",
        json_schema_extra=when_unset("a name Pulumi generates for the stack's bucket"),
    )
    existing_bucket: bool = Field(
        default=False,
        description="true: bucketName is the organisation's existing bucket, referenced and not managed here",
    )
    dataset_prefix: str = Field(
        default="datasets/",
        pattern=r"^[A-Za-z0-9._/-]+/$",
        description="key prefix of the prepared datasets in the bucket",
    )
    checkpoint_prefix: str = Field(
        default="checkpoints/",
        pattern=r"^[A-Za-z0-9._/-]+/$",
        description="key prefix of the checkpoints in the bucket (FSx exports them there)",
    )
    log_prefix: str = Field(
        default="logs/",
        pattern=r"^[A-Za-z0-9._/-]+/$",
        description="key prefix of the logs in the bucket (expired after lifecycle.logExpireDays)",
    )
    lifecycle: Lifecycle = Field(default=Lifecycle(), description="S3 lifecycle of checkpoints, logs and old versions")
    fsx: FsxConfig = Field(
        default=FsxConfig(),
        description="the FSx for Lustre file system the trainer reads data from and writes checkpoints to",
    )


class Identity(_Base):
    kms_key_arn: str | None = Field(
        default=None,
        pattern=r"^arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:key/[0-9a-f-]{36}$",
        description="an existing KMS key for the data (bucket, FSx, logs)",
        json_schema_extra=when_unset("the stack creates a KMS key"),
    )
    kms_key_rotation: bool = Field(default=True, description="yearly rotation of the KMS key the stack creates")
    pod_identity: Literal["irsa", "pod-identity"] = Field(
        default="irsa",
        description="how pods get AWS credentials: IRSA (service account annotation) or EKS Pod Identity",
    )


class MonitoringConfig(_Base):
    log_retention_days: int = Field(
        default=30, description="CloudWatch Logs retention of the stack's log groups, in days"
    )
    gpu_util_floor_percent: float = Field(
        default=40.0,
        gt=0,
        le=100,
        description="alarm when a node's mean GPU (NeuronCore on Trainium) utilisation stays below this "
        "for gpuUtilWindowMinutes",
    )
    gpu_util_window_minutes: int = Field(
        default=30,
        ge=5,
        # The per-node utilisation alarms are Metrics Insights queries, which evaluate at most the latest
        # 3 hours (CloudWatch's limit for such alarms).
        le=180,
        description="the window of the per-node GPU utilisation alarm (at most 180: a Metrics Insights alarm "
        "evaluates the latest 3 hours)",
    )
    notification_email: str = Field(
        pattern=r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$", description="where the alarms are sent (SNS email subscription)"
    )
    fsx_free_capacity_floor_percent: float = Field(
        default=10.0, gt=0, lt=100, description="alarm when FSx free capacity falls below this percentage"
    )
    step_stall_minutes: int = Field(
        default=15, ge=5, le=1440, description="alarm when the trainer's step has not advanced for this long"
    )
    throughput_floor_fraction: float = Field(
        default=0.5, gt=0, le=1, description="alarm below this fraction of the plan's tokens/s estimate"
    )
    plan_drift_fraction: float = Field(
        default=0.5,
        gt=0,
        le=10,
        description="alarm when the measured step time is off the plan's estimate by more than this fraction, "
        "either way, for stepStallMinutes: the plan's layout choices and costs rest on that estimate",
    )
    restart_alarm_count: int = Field(
        default=2,
        ge=1,
        description="alarm when the trainer starts more often "
        "than this within an hour (each restart resumes from a checkpoint)",
    )
    # An hour: longer than Kueue's pods-ready timeout (45 min, components/addons/kueue.yaml), after which
    # a job that did not start is requeued, and than its first requeue backoffs, so one slow start or one
    # eviction does not page; work that waits an hour for quota is a queue short of it. It is also the
    # window the p95 is taken over (the relay supernode.trainer.queue_wait); a queue that admits nothing
    # alarms through its oldest pending workload at training priority or above reaching it.
    queue_wait_p95_minutes: int = Field(
        default=60,
        ge=5,
        le=1440,
        description="alarm when a training ClusterQueue's admission wait p95, over a window this long, "
        "reaches this many minutes (per team's queue)",
    )
    # One job in four: a team's jobs failing that often is a broken image, config or node, not bad luck;
    # a lone failure in a quiet window (one of one) alarms too, which is meant: it is that team's whole work.
    job_failure_rate_max: float = Field(
        default=0.25,
        gt=0,
        lt=1,
        description="alarm when more than this fraction of a team's finished jobs failed within "
        "jobFailureWindowHours (failed / (failed + succeeded), the training operator's counts)",
    )
    # Six hours: long enough to hold several of a team's jobs' ends, short enough that the alarm clears
    # the same working day once jobs succeed again. CloudWatch caps an alarm's period at a day.
    job_failure_window_hours: int = Field(
        default=6, ge=1, le=24, description="the window of the job failure rate alarm, in hours"
    )
    # Serving SLOs (issue 38 item 4): the relay supernode.trainer.serving_slo takes vLLM's TTFT and ITL
    # p99 over this window (the targets are inference.ttftTargetMs / itlTargetMs); five minutes hold
    # enough requests for a p99 to mean something at serving rates and still page within minutes.
    serving_slo_window_minutes: int = Field(
        default=5,
        ge=1,
        le=60,
        description="the window the serving TTFT / ITL p99, request rate and error rate are taken over "
        "(the alarms compare them with inference.ttftTargetMs, itlTargetMs and servingErrorRateMax)",
    )
    # One request in a hundred failing inside the server (vLLM's finished_reason "error": a 500) is an
    # engine in trouble, not a client's bad request (those are refused before the engine counts them).
    serving_error_rate_max: float = Field(
        default=0.01,
        gt=0,
        lt=1,
        description="alarm when more than this fraction of the requests a model finished within "
        "servingSloWindowMinutes failed in the server (vLLM's request_success, finished_reason error)",
    )

    @field_validator("log_retention_days")
    @classmethod
    def _retention(cls, v: int) -> int:
        if v not in CW_RETENTION_DAYS:
            raise ValueError(f"CloudWatch accepts retention of {', '.join(map(str, CW_RETENTION_DAYS))} days")
        return v


# The digest the stack files ship with while no image has been built: `make image` prints the real
# one. The image-placeholder policy reports every image that still carries it.
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
# The add-on containers (components/addons/*.yaml) whose image a stack may set in images.addons, and the
# NVIDIA DRA driver (one image for all its containers; installed where the NVLink domain spans nodes).
AddonImage = Literal[
    "aws-efa-k8s-device-plugin",
    "cloudwatch-agent",
    "dcgm-exporter",
    "kueue",
    "lws",
    "neuron-device-plugin",
    "neuron-monitor",
    "nvidia-device-plugin",
    "nvidia-dra-driver-gpu",
    "prometheus",
    "prometheus-adapter",
    "training-operator",
]
IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*[a-z0-9](:[\w][\w.-]{0,127})?(@sha256:[0-9a-f]{64})?$")


def _image_reference(v: str) -> str:
    """An image by tag (not `latest`) or digest: what an add-on may run."""
    named = "@" in v or ":" in v.rsplit("/", 1)[-1]
    if not IMAGE_RE.fullmatch(v) or not named or v.split("@")[0].endswith(":latest"):
        raise ValueError("not an image pinned by tag or digest; use REPOSITORY:TAG@sha256:<64 hex digits>")
    return v


ImageReference = Annotated[str, AfterValidator(_image_reference)]


class Images(_Base):
    trainer: str = Field(
        description="the trainer image, pinned by digest: `make image STACK=<stack>` builds it and prints this line"
    )
    fabric_check: str | None = Field(
        default=None,
        description="the image of the interconnect gate and the fabric re-run, pinned by digest",
        json_schema_extra=when_unset("the trainer image (it carries supernode.trainer.node.fabric)"),
    )
    addons: dict[AddonImage, ImageReference] = Field(
        default={},
        description="add-on container -> image, pinned as REPOSITORY:TAG@sha256:<digest>; an add-on "
        "not listed runs the tag its file in components/addons/ pins",
    )
    require_digests: bool = Field(
        default=False,
        description="true (prod): the image-digests and image-placeholder policies are mandatory; "
        "false: advisory, so a dev stack may run add-ons by tag",
    )

    @field_validator("trainer", "fabric_check")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is not None and not DIGEST_RE.fullmatch(v):
            raise ValueError("image must be pinned by digest: REPOSITORY@sha256:<64 hex digits>")
        return v


class Model(_Base):
    # Upper bounds well beyond any published MoE (DeepSeek-V3: 61 layers, dim 7168, 256 experts, a 129k
    # vocabulary; Kimi K2: 384 experts): a typo of a few digits is an error here, not an estimate that
    # loops over 10**15 layers.
    layers: int = Field(ge=1, le=1024, description="transformer layers")
    dim: int = Field(ge=8, le=65536, description="model (hidden) dimension")
    heads: int = Field(ge=1, le=1024, description="attention heads")
    kv_heads: int = Field(ge=1, le=1024, description="key/value heads (grouped-query attention); divides heads")
    experts: int = Field(ge=1, le=4096, description="routed experts per MoE layer")
    top_k: int = Field(ge=1, le=64, description="experts each token is routed to")
    shared_experts: int = Field(
        default=0, ge=0, le=64, description="experts every token passes through, besides the routed ones"
    )
    expert_hidden: int = Field(ge=1, le=262144, description="hidden size of one expert's MLP")
    dense_hidden: int = Field(
        ge=1,
        le=262144,
        description="hidden size of a dense layer's MLP (firstDenseLayers, and the layers between MoE ones)",
    )
    moe_every: int = Field(default=1, ge=1, le=1024, description="every n-th layer is MoE; 1: all")
    first_dense_layers: int = Field(default=0, ge=0, le=1024, description="leading layers that are dense, not MoE")
    vocab: int = Field(ge=2, le=1 << 22, description="vocabulary size: at least the data's tokenizer vocabulary")
    seq_len: int = Field(ge=2, le=1 << 20, description="tokens per training sequence")
    router: Literal["softmax", "sigmoid"] = Field(
        default="softmax", description="router scores: softmax, or sigmoid (normalised over the chosen experts)"
    )
    load_balance_coef: float = Field(
        default=0.0,
        ge=0,
        description="weight of the auxiliary load-balancing loss (0: off; the bias update balances instead)",
    )
    z_loss_coef: float = Field(default=0.0, ge=0, description="weight of the router z-loss (0: off)")
    bias_update_rate: float = Field(default=1e-3, ge=0, description="aux-loss-free expert bias step")
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base frequency")
    tie_embeddings: bool = Field(
        default=False, description="the output head shares the input embedding's weights (pp 1 only)"
    )
    qk_norm: bool = Field(
        default=False,
        description="RMS-normalise q and k per head before RoPE (Qwen3's "
        "attention; needed to export a softmax-router model as Qwen3MoeForCausalLM)",
    )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_dense_layers and (layer - self.first_dense_layers) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        """The layers `is_moe` picks: every moeEvery-th from firstDenseLayers on (counted, not walked:
        the layout search asks this for every candidate)."""
        return -(-max(0, self.layers - self.first_dense_layers) // self.moe_every)


# The degrees (dpReplicate, dpShard, tp, ep, pp) are declared once, by the Mesh; Parallel adds the
# layout's options. (No docstring: docs/configuration.md would print it.)
class Parallel(_Base, Mesh):
    pp_schedule: Literal["gpipe", "1f1b", "interleaved1f1b"] = Field(
        default="1f1b",
        description="pipeline schedule (pp > 1): gpipe holds every micro-batch's activations, 1f1b "
        "at most pp, interleaved1f1b (ppVirtualStages >= 2) shrinks the bubble",
    )
    pp_virtual_stages: int = Field(
        default=1,
        ge=1,
        description="stages per rank (interleaved1f1b): the bubble is "
        "(pp-1)/(m*v + pp-1) for m micro-batches per step and v virtual stages",
    )
    pp_first_stage_fewer_layers: int = Field(
        default=0, ge=0, description="the first stage holds this many layers fewer than an even split (it also embeds)"
    )
    pp_last_stage_fewer_layers: int = Field(
        default=0,
        ge=0,
        description="the last stage holds this many layers "
        "fewer than an even split (it also runs the norm, head and loss)",
    )
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        default="none",
        description="recompute activations in the backward pass: none, selective (the FFN/MoE internals) or "
        "full (every block)",
    )
    overlap: bool = Field(
        default=True,
        description="overlap communication with compute: prefetch the next block's FSDP weights, dispatch tokens "
        "asynchronously",
    )
    all_to_all_chunks: int = Field(
        default=2,
        ge=1,
        le=64,
        description="with overlap and ep > 1: pieces each MoE layer's token copies travel in, so one piece's "
        "all-to-all runs while another's experts compute (1: only the shared expert hides the dispatch)",
    )
    mixed_precision: Literal["bf16", "fp32"] = Field(
        default="bf16",
        description="bf16: compute in bf16 from fp32 master weights, gradients reduced in fp32; fp32: all in fp32",
    )
    hbm_headroom: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="fraction of HBM the plan keeps free (allocator fragmentation, NCCL "
        "growth): a layout fits when its memory per rank is within the rest",
    )

    @property
    def compute_bytes(self) -> int:
        """Bytes of an activation and of a gathered weight in the compute dtype: what the planner costs."""
        return 2 if self.mixed_precision == "bf16" else 4

    def computed_on(self, device_type: str) -> Parallel:
        """This layout as `device_type` computes it, the one rule the planner and the trainer share: a
        CPU computes in fp32 whatever mixedPrecision says (its bf16 matmuls are slow and imprecise)."""
        if device_type == "cpu" and self.mixed_precision != "fp32":
            return self.model_copy(update={"mixed_precision": "fp32"})
        return self

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp ranks x virtual stages per rank."""
        return self.pp * self.pp_virtual_stages


# Parallel keys sized per world, so `local` does not inherit them: the degrees and the pipeline's shape.
LOCAL_LAYOUT_KEYS = (
    *Mesh.model_fields,
    "pp_schedule",
    "pp_virtual_stages",
    "pp_first_stage_fewer_layers",
    "pp_last_stage_fewer_layers",
)


def stack_key(key: str, local: bool) -> str:
    """The stack-file key a user changes to set `key` ("model.vocab") of a plan: a local run's model
    and training keys come from the `local` section, which overrides the stack's."""
    return f"local.{key}" if local and key.split(".", 1)[0] in ("model", "training") else key


class DataSource(_Base):
    path: str = Field(
        min_length=1,
        description="a prepared dataset directory, relative to the trainer's --data "
        "(in the cluster the FSx /datasets mount)",
    )
    weight: float = Field(default=1.0, gt=0, description="share of the samples, relative to the blend's other weights")


class Training(_Base):
    global_batch: int = Field(ge=1, le=1 << 24, description="sequences per optimizer step")
    micro_batch: int = Field(
        ge=1,
        le=1 << 16,
        description="sequences per forward/backward on one rank; gradients accumulate up to globalBatch",
    )
    steps: int = Field(ge=1, le=10**9, description="optimizer steps of the run")
    min_nodes: int | None = Field(
        default=None,
        ge=1,
        description="elastic training: the fewest training nodes the job runs on (the PyTorchJob's "
        "minReplicas); the plan gives a layout for every node count from this to the training nodes, "
        "each keeping globalBatch by accumulation (docs/architecture.md, elastic training and spare nodes)",
        json_schema_extra=when_unset("the training nodes: the job is not elastic"),
    )
    lr: float = Field(gt=0, le=1, description="peak learning rate")
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="the schedule's final learning rate as a fraction of lr"
    )
    warmup_steps: int = Field(default=0, ge=0, description="steps of linear warm-up to lr")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="learning-rate decay after warm-up"
    )
    weight_decay: float = Field(default=0.1, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(default=1.0, gt=0, description="clip the global gradient norm to this")
    checkpoint_interval: int = Field(
        ge=1, le=10**9, description="steps between checkpoints (the last step, SIGTERM and SIGINT also save)"
    )
    keep_checkpoints: int = Field(
        default=3, ge=1, le=1000, description="checkpoints kept on FSx (older ones pruned; S3 keeps the history)"
    )
    async_checkpoint: bool = Field(
        default=True, description="save in the background: training blocks only while the state is staged"
    )
    collective_timeout_s: int = Field(
        default=600, ge=10, le=86400, description="seconds a collective may wait before the run fails (a hung rank)"
    )
    stall_restart_s: int = Field(
        default=900,
        ge=11,
        le=86400,
        description="seconds a worker may go without progress (a phase reached, a step done) before its launcher "
        "kills it and torchrun restarts the workers from the newest checkpoint; above collectiveTimeoutS, so a "
        "hung collective fails first with its own error",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="worker restarts (torchrun --max-restarts, the job's backoffLimit), each resuming from the "
        "newest checkpoint, before the run fails",
    )
    max_non_finite_steps: int = Field(
        default=5,
        ge=1,
        description="consecutive steps with a non-finite loss or "
        "gradient norm (their updates skipped) before the run stops, exit 1",
    )
    seed: int = Field(default=0, description="random seed of the initialisation and the data order")
    run: str | None = Field(
        default=None,
        pattern=RUN_ID.pattern,
        description="the run the cluster job trains into (runs/<run>/ on FSx and under checkpointPrefix in S3, "
        "with its run.json): the same name resumes it, a new name starts a fresh run (from initFrom or the seed). "
        "`supernode train --local` takes --run instead",
        json_schema_extra=when_unset("the stack's name: every job of the stack continues one run"),
    )

    @field_validator("run")
    @classmethod
    def _not_new(cls, v: str | None) -> str | None:
        if v == NEW:
            raise ValueError(f"'{NEW}' is the word `supernode train --run` takes for a fresh id; name the run")
        return v

    init_from: str | None = Field(
        default=None,
        min_length=1,
        description="a Hugging Face model directory (Glm4MoeForCausalLM or Qwen3MoeForCausalLM) the run starts "
        "from: a local or FSx path, or an s3:// prefix the cluster job downloads. Its manifest.json (written by "
        "`supernode export`, or `supernode import --write-manifest`) is verified file by file before step 0 "
        "loads it; optimizer and data position start fresh, and once the run has a checkpoint, resuming wins",
        json_schema_extra=when_unset("random initialisation (seed)"),
    )
    init_from_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of initFrom's manifest.json: pins the weights (the manifest pins every file)",
        json_schema_extra=when_unset("not pinned (with initFrom set, the weights-verified policy warns)"),
    )
    data: list[DataSource] = Field(
        default_factory=list,
        description="a blend of prepared datasets, sampled by "
        "weight (deterministic for the seed); empty: the dataset at the trainer's --data. "
        "Windows may cross documents (EOS separates them; see documentMasking)",
    )
    document_masking: bool = Field(
        default=False,
        description="false: a window of seqLen tokens cut from the "
        "token stream is one causal sequence, so a token may attend across the EOS into "
        "the previous document; true: each token attends only within its own document, "
        "RoPE positions restart at each document and the target after an EOS (the next "
        "document's first token) is not counted in the loss, which is divided by the "
        "step's counted tokens. Needs the datasets' manifests to record their EOS id",
    )


class Workload(_Base):
    namespace: str = Field(
        default="training", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="the trainer's Kubernetes namespace"
    )
    service_account: str = Field(
        default="trainer",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="the trainer's Kubernetes service account (bound to its IAM role)",
    )
    gate_min_fraction: float = Field(
        default=0.8, gt=0, le=1.5, description="interconnect gate: fraction of the catalog baseline"
    )
    termination_grace_s: int = Field(
        default=900, ge=30, description="seconds a trainer pod has after SIGTERM (it checkpoints) before it is killed"
    )
    hugepages_2mi_gib: int = Field(
        default=5, ge=0, description="GiB of 2 MiB huge pages reserved on each GPU node (EFA's libfabric uses them)"
    )
    fabric_check_schedule: str = Field(
        default="0 3 * * 0",
        pattern=r"^\S+( \S+){4}$",
        description="cron schedule of the fabric re-run compared with the deploy-time baseline",
    )
    fabric_regression: float = Field(
        default=0.2,
        gt=0,
        lt=1,
        description="a node pair regresses below (1 - this) "
        "x its baseline bandwidth (or above its latency / (1 - this))",
    )
    restore_drill_schedule: str = Field(
        default="0 5 1 * *", pattern=r"^\S+( \S+){4}$", description="cron schedule of the checkpoint restore drill"
    )
    checkpoint_retention_schedule: str = Field(
        default="30 4 * * *",
        pattern=r"^\S+( \S+){4}$",
        description="cron schedule of `supernode checkpoints --retain` in the cluster: tags each run's checkpoints "
        "in S3 milestone or window for the bucket's lifecycle rules (a step not tagged yet is kept)",
    )
    unchecked_nodes: Literal["hold", "admit"] = Field(
        default="hold",
        description="a GPU node whose health checks did not all run (a tool missing from the agent's image, "
        "refused or timed out): hold keeps it unadmitted (supernode.io/unchecked) and quarantined ones held "
        "until every check runs; admit lets the checks that ran decide. Either way each round counts them "
        "and the node-checks-not-run alarm fires",
    )
    inventory_interval_minutes: int = Field(
        default=60,
        ge=5,
        le=1440,
        description="how often the inventory DaemonSet compares each GPU node with its baseline",
    )
    max_clock_offset_ms: float = Field(
        default=10.0,
        gt=0,
        le=1000,
        description="the inventory flags a GPU node "
        "whose clock offset (chrony, or the kernel's estimated error) exceeds this",
    )


class Inference(_Base):
    """Serving the training run's export with vLLM: in the cluster (components/k8s/serving.py) and
    locally (`supernode serve --local`). Sized by the inference planner (supernode/core/inference.py)."""

    image: str = Field(description="the vLLM server image, pinned by digest: REPOSITORY@sha256:<64 hex digits>")
    weights_prefix: str = Field(
        default="models/",
        pattern=r"^[A-Za-z0-9._/-]+/$",
        description="where `supernode export` output is pushed, under the stack's bucket; "
        "the pods copy it from the FSx mount (/models) and verify it",
    )
    manifest_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the export's manifest.json: pins the weights the init container verifies file by file",
        json_schema_extra=when_unset(
            "the weights are not pinned: the init container verifies the files against the manifest it finds"
        ),
    )
    tp: int = Field(default=1, ge=1, description="tensor-parallel degree of one replica")
    pp: int = Field(default=1, ge=1, description="pipeline stages of one replica (> 1 node: a LeaderWorkerSet)")
    layout: Literal["auto", "tp", "ep"] = Field(
        default="auto",
        description="how a replica's tp x pp GPUs are laid out: tp (tensor x pipeline parallel), ep (data "
        "parallel attention + expert parallel MoE, vLLM --enable-expert-parallel), or auto: the inference "
        "planner's choice by its memory and ITL/TTFT estimates",
    )
    dtype: Literal["bf16", "fp16", "fp32"] = Field(
        default="bf16", description="the served weights' dtype (vLLM --dtype)"
    )
    max_seq_len: int = Field(default=4096, ge=16, description="vLLM --max-model-len")
    max_concurrency: int = Field(default=64, ge=1, description="sequences batched at once (vLLM --max-num-seqs)")
    replicas_min: int = Field(default=1, ge=1, description="fewest serving replicas (the HPA's minReplicas)")
    replicas_max: int = Field(default=1, ge=1, description="most serving replicas (the HPA's maxReplicas)")
    target_running_per_replica: int = Field(
        default=32,
        ge=1,
        description="autoscaling: add a replica when requests running + waiting per replica exceed this",
    )
    ttft_target_ms: float | None = Field(
        default=None,
        gt=0,
        description="time to first token, p99",
        json_schema_extra=when_unset("no target: the inference plan reports the estimate without judging it"),
    )
    itl_target_ms: float | None = Field(
        default=None,
        gt=0,
        description="inter-token latency, p99",
        json_schema_extra=when_unset("no target: the inference plan reports the estimate without judging it"),
    )
    namespace: str = Field(
        default="serving", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="the serving Kubernetes namespace"
    )
    allowed_client_namespaces: list[str] = Field(
        default=["gateway"], description="namespaces whose pods may reach the server (NetworkPolicy); nothing else may"
    )
    gpu_quota: int | None = Field(
        default=None,
        ge=1,
        description="GPUs the serving namespace may request (ResourceQuota); default replicasMax x GPUs per replica",
        json_schema_extra=when_unset("replicasMax x GPUs per replica"),
    )

    @field_validator("image")
    @classmethod
    def _digest(cls, v: str) -> str:
        if not DIGEST_RE.fullmatch(v):
            raise ValueError("image must be pinned by digest: REPOSITORY@sha256:<64 hex digits>")
        return v

    @field_validator("replicas_max")
    @classmethod
    def _replicas(cls, v: int, info) -> int:
        low = info.data.get("replicas_min")
        if low is not None and v < low:
            raise ValueError(f"replicasMax must be at least replicasMin ({low})")
        return v


def _partial(model: type[_Base], without: tuple[str, ...] = ()) -> type[_Base]:
    """The same fields less `without`, all optional: used by `local` to override parts of the plan."""
    fields = {name: (f.annotation | None, None) for name, f in model.model_fields.items() if name not in without}
    return create_model(f"{model.__name__}Override", __base__=_Base, **fields)


ModelOverride = _partial(Model)
ParallelOverride = _partial(Parallel)
# A local plan is elastic over every world 1..nproc, so it has no minimum of its own.
TrainingOverride = _partial(Training, without=("min_nodes",))


class Local(_Base):
    """Scales the same plan down for a CPU run (gloo): world size = nproc. model and training keys
    override the stack's; the mesh degrees (dpReplicate, dpShard, tp, ep, pp and the pipeline keys)
    come from local.parallel only (default 1, dpShard filling nproc), the rest of parallel is inherited."""

    nproc: int = Field(
        default=2, ge=1, le=16, description="CPU processes of `supernode train --local` (its world size)"
    )
    model: ModelOverride = Field(  # type: ignore[valid-type]
        default=ModelOverride(), description="model keys overriding the stack's for the local run"
    )
    parallel: ParallelOverride = Field(  # type: ignore[valid-type]
        default=ParallelOverride(),
        description="the local run's mesh degrees and pipeline keys (not inherited); other parallel keys override "
        "the stack's",
    )
    training: TrainingOverride = Field(  # type: ignore[valid-type]
        default=TrainingOverride(), description="training keys overriding the stack's for the local run"
    )


class Team(_Base):
    """A team that shares the training pool (issue 36, item 4): its own namespace, LocalQueue,
    ClusterQueue in the pool's cohort and ResourceQuota, and an IAM role whose members are the team
    on the cluster (supernode.core.teams names them). Quotas are in devices of the training pool (the
    accelerator device resource the pods request: GPUs; Neuron devices on Trainium), whole nodes."""

    name: str = Field(
        pattern=TEAM_NAME,
        description="the team's name (a job file's `team`): its namespace is team-<name>, its ClusterQueue "
        "gpu-<accelerator>-<name>, its Kubernetes group supernode:team:<name>",
    )
    nominal_quota: int = Field(
        ge=0,
        description="devices of the training pool guaranteed to the team (its ClusterQueue's nominalQuota); "
        "the teams' quotas add up to training's share of the pool (the accelerators-pools-add-up policy)",
    )
    borrowing_limit: int = Field(
        default=0,
        ge=0,
        description="devices the team may borrow beyond its quota from what the other teams lend; its "
        "ResourceQuota and the most a job of it may ask are nominalQuota + borrowingLimit",
    )
    lending_limit: int = Field(
        default=0,
        ge=0,
        description="devices of its quota the team lends to the cohort while it does not use them (at most "
        "nominalQuota); together the teams lend at most what training may lend (its share less its spares "
        "and the stack's job's minimum)",
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="the team's fair-sharing weight (its ClusterQueue's fairSharing.weight): a higher one "
        "gets more of what is lent and is preempted later",
    )
    principal: str = Field(
        pattern=r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+$",
        description="the IAM role whose members are the team: its EKS access entry maps it to the team's "
        "Kubernetes group, bound to the team's namespace only",
    )


def _management_cidr(value: str) -> str:
    """A range the management interface admits: a valid network, never the whole internet."""
    import ipaddress

    try:
        net = ipaddress.ip_network(value, strict=True)
    except ValueError as e:
        raise ValueError(f"not a valid CIDR ({e}); e.g. 10.20.0.0/16") from None
    if net.prefixlen == 0:
        raise ValueError("the whole internet is not a management range: list the organisation's networks")
    return value


class Oidc(_Base):
    """The identity provider the load balancer authenticates people with (an ALB authenticate-oidc
    action): its endpoints, the client the stack registered there, and the claim naming a person's groups."""

    issuer: str = Field(pattern=r"^https://[^\s]+$", description="the provider's issuer URL")
    authorization_endpoint: str = Field(pattern=r"^https://[^\s]+$", description="its authorization endpoint")
    token_endpoint: str = Field(pattern=r"^https://[^\s]+$", description="its token endpoint")
    user_info_endpoint: str = Field(pattern=r"^https://[^\s]+$", description="its user info endpoint")
    client_id: str = Field(min_length=1, description="the client registered for the management page")
    client_secret_parameter: str = Field(
        pattern=r"^/[\w./-]+$",
        description="the SSM SecureString parameter holding the client's secret (never in the stack file)",
    )
    groups_claim: str = Field(
        default="groups",
        min_length=1,
        description="the claim listing a person's groups; supernode:team:<name> and supernode:admins are "
        "the same groups the CLI's access entries map to",
    )
    scope: str = Field(
        default="openid email groups",
        pattern=r"^openid( [\w:.-]+)*$",
        description="the scopes the load balancer asks for: openid and those releasing the groups claim",
    )


class ManagementUi(_Base):
    """The management page in the cluster (issue 37, item 2): behind an internal ALB with TLS and OIDC."""

    certificate_arn: str = Field(
        pattern=r"^arn:aws[a-z-]*:acm:[a-z0-9-]+:\d{12}:certificate/[\w-]+$",
        description="the ACM certificate of hostName: the load balancer's HTTPS listener presents it",
    )
    host_name: str = Field(
        pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$", description="the page's DNS name (the certificate's)"
    )
    oidc: Oidc = Field(description="the identity provider people log in with")
    audit_retention_days: int = Field(
        default=365, description="days the audit log group (every submit and cancel) keeps its records"
    )

    @field_validator("audit_retention_days")
    @classmethod
    def _retention(cls, v: int) -> int:
        if v not in CW_RETENTION_DAYS:
            raise ValueError(f"CloudWatch accepts retention of {', '.join(map(str, CW_RETENTION_DAYS))} days")
        return v


class ManagementConfig(_Base):
    """Who reaches the stack's management interfaces: the ranges its load balancer admits."""

    allowed_cidrs: list[Annotated[str, AfterValidator(_management_cidr)]] = Field(
        default=[],
        description="the networks (the organisation's, a VPN's) admitted to the management page's load "
        "balancer; never 0.0.0.0/0 or ::/0",
    )
    ui: ManagementUi | None = Field(
        default=None,
        description="the management page in the cluster",
        json_schema_extra=when_unset("the page is not deployed (`supernode ui --local` still serves it)"),
    )


class StackConfig(_Base):
    region: str = Field(pattern=r"^[a-z]{2}(-gov)?-[a-z]+-\d$", description="the AWS region (equals aws:region)")
    availability_zone: str = Field(description="the AZ (or a Local Zone) of the GPU nodes and their subnet")
    cluster: ClusterConfig = Field(description="the EKS cluster")
    network: NetworkConfig = Field(description="the VPC: created by the stack, or an existing one")
    accelerator_node_groups: list[AcceleratorNodeGroup] = Field(
        min_length=1, description="the GPU node groups; together they are the training job's world"
    )
    system_node_group: SystemNodeGroup = Field(
        default=SystemNodeGroup(), description="the node group for add-ons and controllers"
    )
    storage: StorageConfig = Field(
        default=StorageConfig(), description="the S3 bucket and the FSx for Lustre file system"
    )
    identity: Identity = Field(default=Identity(), description="KMS key and how pods get AWS credentials")
    monitoring: MonitoringConfig = Field(description="alarms, their thresholds and log retention")
    images: Images = Field(description="container images: the trainer, the fabric check, the add-ons")
    model: Model = Field(description="the MoE transformer to train")
    parallel: Parallel = Field(default=Parallel(), description="the parallel layout (mesh degrees) and its options")
    training: Training = Field(description="optimiser, schedule, checkpoints and data")
    workload: Workload = Field(
        default=Workload(), description="the training job's Kubernetes settings and the fabric and restore checks"
    )
    inference: Inference | None = Field(
        default=None,
        description="serving the exported model with vLLM",
        json_schema_extra=when_unset("nothing is served"),
    )
    local: Local = Field(default=Local(), description="the scaled-down CPU run (`supernode train --local`)")
    teams: list[Team] = Field(
        default=[],
        description="the teams that share the training pool, each with its quota, namespace, queue and IAM "
        "role; the first team's queue also admits the stack's own job (the training namespace's)",
        json_schema_extra=when_unset("no teams: training's one ClusterQueue holds its whole share"),
    )
    management: ManagementConfig = Field(
        default=ManagementConfig(), description="the management page in the cluster and who may reach it"
    )
    calibration: str | None = Field(
        default=None,
        min_length=1,
        description="a calibration file (`supernode bench gpu --calibration-out FILE` on this stack's GPU "
        "type), relative to the project directory: the plan's step time uses its measured efficiencies; "
        "without one the plan says its figures are uncalibrated estimates",
        json_schema_extra=when_unset("the plan's figures are uncalibrated estimates (the catalog's peaks)"),
    )

    # -- derived ---------------------------------------------------------------------------
    @property
    def training_node_groups(self) -> list[AcceleratorNodeGroup]:
        """The groups whose accelerators are the training job's world (not serving's reserved share)."""
        return [g for g in self.accelerator_node_groups if g.role == "training"]

    @property
    def accelerators(self) -> int:
        """The training job's world: the training groups' accelerators."""
        return sum(g.nodes * CATALOG[g.instance_type].accelerators for g in self.training_node_groups)

    @property
    def nodes(self) -> int:
        """The training job's nodes (one trainer pod each)."""
        return sum(g.nodes for g in self.training_node_groups)

    def to_mapping(self) -> dict[str, Any]:
        """The `supernode:` keys as Pulumi config holds them (camelCase, defaults included; an absent
        optional section, e.g. `inference`, stays absent: Pulumi config has no null; so does an empty
        `teams`)."""
        return {
            k: v
            for k, v in self.model_dump(by_alias=True, mode="json").items()
            if v is not None and not (k == "teams" and not v)
        }

    def local_config(self) -> StackConfig:
        """This stack with the `local` overrides applied; the layout then has world size nproc.

        The mesh degrees are not inherited: a layout sized for the cluster's world never fits nproc
        CPU processes, so copying a planner suggestion into `parallel` must not break the local run.
        They come from `local.parallel` (default 1), dpShard filling the rest of nproc; everything
        else in `parallel` (activation checkpointing, precision, overlap, headroom) is inherited."""
        data = self.model_dump(by_alias=False)
        for section in ("model", "training"):
            data[section].update(getattr(self.local, section).model_dump(exclude_none=True))
        layout = self.local.parallel.model_dump(exclude_none=True)
        parallel = {k: v for k, v in data["parallel"].items() if k not in LOCAL_LAYOUT_KEYS} | layout
        if "dp_shard" not in layout:
            given = Mesh.model_construct(**{k: v for k, v in layout.items() if k in Mesh.model_fields})
            parallel["dp_shard"] = given.rescaled(self.local.nproc).dp_shard
        data["parallel"] = parallel
        return StackConfig.model_validate(data)


def _value_at(data: Any, loc: tuple) -> Any:
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _present(data: Any, loc: tuple) -> bool:
    """Whether the document holds the key at `loc` (its value may be null)."""
    if not loc:
        return False
    parent = _value_at(data, loc[:-1])
    return isinstance(parent, dict) and loc[-1] in parent


def _path(prefix: str, loc: tuple) -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("" if out.endswith((":", ".")) else ".") + str(part)
    return out


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The schema model that holds the keys at `loc` (list indices skipped), or None."""
    model: Any = StackConfig
    for part in loc:
        if isinstance(part, int):
            continue
        fields = {f.alias or name: f for name, f in model.model_fields.items()}
        if part not in fields:
            return None
        annotation = fields[part].annotation
        for arg in (annotation, *get_args(annotation), *(a for t in get_args(annotation) for a in get_args(t))):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                model = arg
                break
        else:
            return None
    return model


def did_you_mean(key: str, valid: list[str]) -> str:
    """`did you mean 'x'? ` for the closest valid spelling of a mistyped key, else ''."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def _unknown_key(loc: tuple) -> str:
    model = _model_at(loc[:-1])
    valid = sorted(f.alias or name for name, f in model.model_fields.items()) if model else []
    hint = did_you_mean(str(loc[-1]), valid) if loc else ""
    listed = f"valid keys here: {', '.join(valid)}" if valid else "see docs/configuration.md"
    return f"unknown key; {hint or 'remove it or use a documented key; '}{listed}"


def issues_from_validation(err: ValidationError, prefix: str, data: Any) -> list[Issue]:
    out = []
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if p not in ("function-after", "function-plain"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = _unknown_key(loc)
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] == "string_type" and isinstance(e.get("input"), (int, float)):
            msg += f'; quote it in YAML: "{e["input"]}"'
        missing = e["type"] == "missing"
        if not missing and e.get("input") is None and _present(data, loc):
            # YAML reads `key:` with nothing after it, or with its lines indented as its siblings, as null
            msg = "has no value: its YAML line ends at the colon, or the lines meant for it are not indented under it"
            missing = True
        value = None if missing else e.get("input")
        out.append(
            Issue(
                path=_path(prefix, loc),
                value=value if value is not None else _value_at(data, loc),
                message=msg,
                missing=missing,
            )
        )
    return out
