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


class _Base(BaseModel):
    # Strict: `nodes: true` or `nodes: "2"` is an error naming the key, not a silent 1 or 2 (YAML and
    # JSON give every value its type already; a float field still takes an integer).
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True, strict=True)


class ClusterConfig(_Base):
    kubernetes_version: str = Field(pattern=r"^1\.(2[89]|3[0-9])$")
    endpoint_private_access: bool = True
    endpoint_public_access: bool = False
    public_access_cidrs: list[str] = []


SubnetId = Annotated[str, Field(pattern=r"^subnet-[0-9a-f]{8,17}$")]


class NetworkConfig(_Base):
    """A VPC the stack creates (the *Cidrs keys), or an existing one (existingVpcId and the
    existing*SubnetId(s) keys). vpcCidr is required either way: security-group rules use it, and
    preflight compares it with the existing VPC's."""

    vpc_cidr: str
    availability_zones: list[str] = Field(min_length=2, description="AZs of the private subnets")
    private_subnet_cidrs: list[str] = []  # required unless existingVpcId (infra_rules)
    public_subnet_cidrs: list[str] = []
    gpu_subnet_cidr: str | None = None  # required unless existingVpcId (infra_rules)
    nat_gateway: bool | None = None  # default: on for a VPC the stack creates, off in an existing one
    flow_logs: bool = True
    existing_vpc_id: str | None = Field(default=None, pattern=r"^vpc-[0-9a-f]{8,17}$")
    existing_private_subnet_ids: list[SubnetId] = Field(default=[], description="one per availabilityZones entry")
    existing_gpu_subnet_id: SubnetId | None = Field(default=None, description="in the GPU availabilityZone")

    @property
    def use_nat_gateway(self) -> bool:
        return self.nat_gateway if self.nat_gateway is not None else self.existing_vpc_id is None


# Capacity Blocks: EC2 terminates the instances from 30 min before the end; EKS wants the node group at 0
# by 40 min before (docs/hardware.md "Buying and placing").
CAPACITY_BLOCK_DRAIN = timedelta(minutes=40)


class Capacity(_Base):
    type: Literal["on-demand", "capacity-reservation", "capacity-block"] = "on-demand"
    reservation_id: str | None = Field(default=None, pattern=r"^cr-[0-9a-f]{8,17}$")
    availability_zone: str | None = None
    ends_at: AwareDatetime | None = Field(
        default=None,
        strict=False,  # an ISO string in the stack file (and in Pulumi's runtime config) is the way to write it
        description="capacity-block only, required there: the block's end (EC2's EndDate) as an ISO "
        "date-time with its offset, e.g. 2026-03-14T11:30:00Z. The node group is scaled to 0 forty minutes before "
        "(EC2 terminates the instances from 30 minutes before); preflight compares it with EC2",
    )

    @property
    def scale_to_zero_at(self) -> datetime | None:
        """When a capacity-block node group goes to 0 nodes (UTC): EKS's guide says 40 minutes before
        the block's end, 10 before EC2 starts terminating its instances, so pods are drained (the
        trainer checkpoints on SIGTERM) instead of killed."""
        return None if self.ends_at is None else (self.ends_at - CAPACITY_BLOCK_DRAIN).astimezone(UTC)


class AcceleratorNodeGroup(_Base):
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,30}$")
    instance_type: str
    nodes: int = Field(ge=1, le=512)
    capacity: Capacity = Capacity()
    ami_release_version: str = Field(pattern=r"^1\.\d+\.\d+-\d{8}$")
    placement_group: bool | None = None  # default: on, unless a reservation is targeted
    require_efa: bool = True
    ultra_server: str | None = Field(
        default=None,
        description="the UltraServer this group is (e.g. "
        "u-p6e-gb200x72): its instances form one NVLink domain, bought as one "
        "Capacity Block (capacity.reservationId)",
    )

    @field_validator("instance_type")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in CATALOG:
            raise ValueError(f"instance type is not in the accelerator catalog; valid: {', '.join(CATALOG)}")
        return v

    @field_validator("ultra_server")
    @classmethod
    def _ultra_server(cls, v: str | None) -> str | None:
        if v is not None and v not in ULTRASERVERS:
            raise ValueError(f"not a known UltraServer type; valid: {', '.join(ULTRASERVERS)}")
        return v

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
    checkpoint_milestone_every: int = Field(
        default=10,
        ge=1,
        le=10**6,
        description="every k-th checkpoint of a run (by step: step / training.checkpointInterval a multiple "
        "of k), and each run's newest, is a milestone that S3 keeps after checkpointExpireDays "
        "(`supernode checkpoints --retain` tags them; the lifecycle rules expire only the rest)",
    )
    noncurrent_expire_days: int = Field(default=7, ge=1)
    log_expire_days: int = Field(default=30, ge=1)
    abort_multipart_days: int = Field(default=3, ge=1, le=30)


class FsxConfig(_Base):
    deployment_type: Literal["PERSISTENT_2"] = "PERSISTENT_2"
    capacity_gib: int | None = Field(default=None, description="None: sized by the planner")
    per_unit_throughput: int = 250
    checkpoint_write_budget_s: int = Field(default=300, ge=10)

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
    bucket_name: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
    existing_bucket: bool = False
    dataset_prefix: str = Field(default="datasets/", pattern=r"^[A-Za-z0-9._/-]+/$")
    checkpoint_prefix: str = Field(default="checkpoints/", pattern=r"^[A-Za-z0-9._/-]+/$")
    log_prefix: str = Field(default="logs/", pattern=r"^[A-Za-z0-9._/-]+/$")
    lifecycle: Lifecycle = Lifecycle()
    fsx: FsxConfig = FsxConfig()


class Identity(_Base):
    kms_key_arn: str | None = Field(default=None, pattern=r"^arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:key/[0-9a-f-]{36}$")
    kms_key_rotation: bool = True
    pod_identity: Literal["irsa", "pod-identity"] = "irsa"


class MonitoringConfig(_Base):
    log_retention_days: int = 30
    gpu_util_floor_percent: float = Field(default=40.0, gt=0, le=100)
    gpu_util_window_minutes: int = Field(default=30, ge=5, le=1440)
    notification_email: str = Field(pattern=r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$")
    fsx_free_capacity_floor_percent: float = Field(default=10.0, gt=0, lt=100)
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

    @field_validator("log_retention_days")
    @classmethod
    def _retention(cls, v: int) -> int:
        if v not in CW_RETENTION_DAYS:
            raise ValueError(f"CloudWatch accepts retention of {', '.join(map(str, CW_RETENTION_DAYS))} days")
        return v


# The digest the stack files ship with while no image has been built: `make image` prints the real
# one. The image-placeholder policy reports every image that still carries it.
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
# The add-on containers (supernode/components/addons/*.yaml) whose image a stack may set in images.addons, and the
# NVIDIA DRA driver (one image for all its containers; installed where the NVLink domain spans nodes).
AddonImage = Literal[
    "aws-efa-k8s-device-plugin",
    "cloudwatch-agent",
    "dcgm-exporter",
    "kueue",
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
    if not IMAGE_RE.match(v) or not named or v.split("@")[0].endswith(":latest"):
        raise ValueError("not an image pinned by tag or digest; use REPOSITORY:TAG@sha256:<64 hex digits>")
    return v


ImageReference = Annotated[str, AfterValidator(_image_reference)]


class Images(_Base):
    trainer: str
    fabric_check: str | None = None  # default: the trainer image (it carries supernode.trainer.node.fabric)
    addons: dict[AddonImage, ImageReference] = Field(
        default={},
        description="add-on container -> image, pinned as REPOSITORY:TAG@sha256:<digest>; an add-on "
        "not listed runs the tag its file in supernode/components/addons/ pins",
    )
    require_digests: bool = Field(
        default=False,
        description="true (prod): the image-digests and image-placeholder policies are mandatory; "
        "false: advisory, so a dev stack may run add-ons by tag",
    )

    @field_validator("trainer", "fabric_check")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is not None and not DIGEST_RE.match(v):
            raise ValueError("image must be pinned by digest: REPOSITORY@sha256:<64 hex digits>")
        return v


class Model(_Base):
    # Upper bounds well beyond any published MoE (DeepSeek-V3: 61 layers, dim 7168, 256 experts, a 129k
    # vocabulary; Kimi K2: 384 experts): a typo of a few digits is an error here, not an estimate that
    # loops over 10**15 layers.
    layers: int = Field(ge=1, le=1024)
    dim: int = Field(ge=8, le=65536)
    heads: int = Field(ge=1, le=1024)
    kv_heads: int = Field(ge=1, le=1024)
    experts: int = Field(ge=1, le=4096)
    top_k: int = Field(ge=1, le=64)
    shared_experts: int = Field(default=0, ge=0, le=64)
    expert_hidden: int = Field(ge=1, le=262144)
    dense_hidden: int = Field(ge=1, le=262144)
    moe_every: int = Field(default=1, ge=1, le=1024, description="every n-th layer is MoE; 1: all")
    first_dense_layers: int = Field(default=0, ge=0, le=1024)
    vocab: int = Field(ge=2, le=1 << 22)
    seq_len: int = Field(ge=2, le=1 << 20)
    router: Literal["softmax", "sigmoid"] = "softmax"
    load_balance_coef: float = Field(default=0.0, ge=0)
    z_loss_coef: float = Field(default=0.0, ge=0)
    bias_update_rate: float = Field(default=1e-3, ge=0, description="aux-loss-free expert bias step")
    rope_theta: float = Field(default=10000.0, gt=0)
    tie_embeddings: bool = False
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
        return sum(self.is_moe(i) for i in range(self.layers))


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
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    overlap: bool = True
    mixed_precision: Literal["bf16", "fp32"] = "bf16"
    hbm_headroom: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="fraction of HBM the plan keeps free (allocator fragmentation, NCCL "
        "growth): a layout fits when its memory per rank is within the rest",
    )

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


class DataSource(_Base):
    path: str = Field(
        min_length=1,
        description="a prepared dataset directory, relative to the trainer's --data "
        "(in the cluster the FSx /datasets mount)",
    )
    weight: float = Field(default=1.0, gt=0, description="share of the samples, relative to the blend's other weights")


class Training(_Base):
    global_batch: int = Field(ge=1, le=1 << 24, description="sequences per optimizer step")
    micro_batch: int = Field(ge=1, le=1 << 16)
    steps: int = Field(ge=1, le=10**9)
    lr: float = Field(gt=0, le=1)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(default=0.1, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    checkpoint_interval: int = Field(ge=1, le=10**9)
    keep_checkpoints: int = Field(default=3, ge=1, le=1000)
    async_checkpoint: bool = True
    collective_timeout_s: int = Field(default=600, ge=10, le=86400)
    max_restarts: int = Field(default=3, ge=0, le=1000)
    max_non_finite_steps: int = Field(
        default=5,
        ge=1,
        description="consecutive steps with a non-finite loss or "
        "gradient norm (their updates skipped) before the run stops, exit 1",
    )
    seed: int = 0
    weights_uri: str | None = None
    weights_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
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
    namespace: str = Field(default="training", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    service_account: str = Field(default="trainer", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    gate_min_fraction: float = Field(
        default=0.8, gt=0, le=1.5, description="interconnect gate: fraction of the catalog baseline"
    )
    termination_grace_s: int = Field(default=900, ge=30)
    hugepages_2mi_gib: int = Field(default=5, ge=0)
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
    """Serving the training run's export with vLLM: in the cluster (supernode/components/k8s/serving.py) and
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
    )
    tp: int = Field(default=1, ge=1, description="tensor-parallel degree of one replica")
    pp: int = Field(default=1, ge=1, description="pipeline stages of one replica (> 1 node: a LeaderWorkerSet)")
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    max_seq_len: int = Field(default=4096, ge=16, description="vLLM --max-model-len")
    max_concurrency: int = Field(default=64, ge=1, description="sequences batched at once (vLLM --max-num-seqs)")
    replicas_min: int = Field(default=1, ge=1)
    replicas_max: int = Field(default=1, ge=1)
    target_running_per_replica: int = Field(
        default=32,
        ge=1,
        description="autoscaling: add a replica when requests running + waiting per replica exceed this",
    )
    ttft_target_ms: float | None = Field(default=None, gt=0, description="time to first token, p99")
    itl_target_ms: float | None = Field(default=None, gt=0, description="inter-token latency, p99")
    namespace: str = Field(default="serving", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    allowed_client_namespaces: list[str] = Field(
        default=["gateway"], description="namespaces whose pods may reach the server (NetworkPolicy); nothing else may"
    )
    gpu_quota: int | None = Field(
        default=None,
        ge=1,
        description="GPUs the serving namespace may request (ResourceQuota); default replicasMax x GPUs per replica",
    )

    @field_validator("image")
    @classmethod
    def _digest(cls, v: str) -> str:
        if not DIGEST_RE.match(v):
            raise ValueError("image must be pinned by digest: REPOSITORY@sha256:<64 hex digits>")
        return v

    @field_validator("replicas_max")
    @classmethod
    def _replicas(cls, v: int, info) -> int:
        low = info.data.get("replicas_min")
        if low is not None and v < low:
            raise ValueError(f"replicasMax must be at least replicasMin ({low})")
        return v


def _partial(model: type[_Base]) -> type[_Base]:
    """The same fields, all optional: used by `local` to override parts of the plan."""
    fields = {name: (f.annotation | None, None) for name, f in model.model_fields.items()}
    return create_model(f"{model.__name__}Override", __base__=_Base, **fields)


ModelOverride = _partial(Model)
ParallelOverride = _partial(Parallel)
TrainingOverride = _partial(Training)


class Local(_Base):
    """Scales the same plan down for a CPU run (gloo): world size = nproc. model and training keys
    override the stack's; the mesh degrees (dpReplicate, dpShard, tp, ep, pp and the pipeline keys)
    come from local.parallel only (default 1, dpShard filling nproc), the rest of parallel is inherited."""

    nproc: int = Field(default=2, ge=1, le=16)
    model: ModelOverride = ModelOverride()  # type: ignore[valid-type]
    parallel: ParallelOverride = ParallelOverride()  # type: ignore[valid-type]
    training: TrainingOverride = TrainingOverride()  # type: ignore[valid-type]


class StackConfig(_Base):
    region: str = Field(pattern=r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
    availability_zone: str
    cluster: ClusterConfig
    network: NetworkConfig
    accelerator_node_groups: list[AcceleratorNodeGroup] = Field(min_length=1)
    system_node_group: SystemNodeGroup = SystemNodeGroup()
    storage: StorageConfig = StorageConfig()
    identity: Identity = Identity()
    monitoring: MonitoringConfig
    images: Images
    model: Model
    parallel: Parallel = Parallel()
    training: Training
    workload: Workload = Workload()
    inference: Inference | None = None
    local: Local = Local()
    calibration: str | None = Field(
        default=None,
        min_length=1,
        description="a calibration file (`supernode bench gpu --calibration-out FILE` on this stack's GPU "
        "type), relative to the project directory: the plan's step time uses its measured efficiencies; "
        "without one the plan says its figures are uncalibrated estimates",
    )

    # -- derived ---------------------------------------------------------------------------
    @property
    def accelerators(self) -> int:
        return sum(g.nodes * CATALOG[g.instance_type].accelerators for g in self.accelerator_node_groups)

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.accelerator_node_groups)

    def to_mapping(self) -> dict[str, Any]:
        """The `supernode:` keys as Pulumi config holds them (camelCase, defaults included; an absent
        optional section, e.g. `inference`, stays absent: Pulumi config has no null)."""
        return {k: v for k, v in self.model_dump(by_alias=True, mode="json").items() if v is not None}

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
