"""The Plan: the one object that sizes the hardware, configures the job and is checked by policy.

Built once from a StackConfig (`build_plan`), serialised once (`Plan.to_json`); the Kubernetes
ConfigMap, the trainer and the policy pack all read that JSON. Nothing re-derives the layout.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from . import capacity as cap
from .catalog import CATALOG, GIB, InstanceType, gate_floor_gbytes_s, nvlink_domain_gpus
from .config import NAMESPACE, Model, Parallel, StackConfig, Training, with_local_nproc
from .errors import BadInput
from .estimate import Layout, estimate, local_worlds, planned_worlds
from .inference import InferencePlan, build_inference_plan
from .layout import domain_rules
from .mesh import Mesh
from .pools import Pool, TeamPool, build_pools, build_team_pools, termination_grace_needed_s
from .search import Suggestion, suggest

# In the cluster the Plan travels as this ConfigMap key, mounted read-only in this directory: the
# workload writes it, the trainer reads it (`--plan PLAN_MOUNT_PATH`), the policy pack checks it.
PLAN_CONFIGMAP_KEY = "plan.json"
PLAN_MOUNT_DIR = "/etc/supernode"
PLAN_MOUNT_PATH = f"{PLAN_MOUNT_DIR}/{PLAN_CONFIGMAP_KEY}"


class Topology(BaseModel):
    """The NVLink domain the stack's GPUs form (supernode.core.topology); where a world's mesh lands
    on it is that world's `Layout.placement`."""

    model_config = ConfigDict(frozen=True)
    ultra_server: str | None  # e.g. u-p6e-gb200x72; None: the domain is one instance
    domain_gpus: int
    nodes_per_domain: int
    # The domain's aggregate HBM: the "global address space" one job's ranks on it share.
    domain_hbm_gib: float
    # One replica's training state (16 B per parameter); whether it fits its shard group's HBM is the
    # layout's `replica_fits`.
    replica_state_gib: float


class Plan(BaseModel):
    """The stack's plan at one world: `world_size` selects its layout from `layouts` (every world the
    job may run at, the planned one last), and every figure that depends on the world (degrees,
    accumulation, pipeline, memory, fit, step time, placement, the run's hours) is read from that
    layout; the other fields describe the stack, the same at any world."""

    model_config = ConfigDict(frozen=True)

    stack: str
    local: bool  # True: the CPU layout from the stack's `local` section
    # The torch device type the plan runs on and is costed for, in the dtype it computes in there
    # (`Parallel.computed_on`): the accelerator's for a cluster plan, cpu for a local one unless it
    # was built for another (`bench gpu` lays the stack's model out on the GPUs of one machine).
    device: str
    instance_type: str
    accelerators_per_node: int
    world_size: int  # the world this plan describes: the planned one unless `for_world` chose another
    model: Model
    training: Training
    # capacity figures
    params: cap.ParamCounts
    flops_per_token: float
    hbm_gib: float
    usable_hbm_gib: float  # HBM less parallel.hbm_headroom: what a rank may plan to use
    # Layouts of the planned world that fit, offered where the planned one does not (empty at another world).
    suggestions: list[Suggestion]
    # The measured efficiencies the step time used (`supernode:calibration` or `plan --calibration`);
    # None: an uncalibrated estimate on the defaults `capacity.UNCALIBRATED` names.
    calibration: cap.Calibration | None = None
    topology: Topology
    checkpoint: cap.CheckpointIO
    # The interconnect gate's all_reduce bus-bandwidth floor in GB/s (catalog baseline x
    # workload.gateMinFraction); None where no baseline is published for the instance type.
    gate_floor_gbytes_s: float | None
    pod: cap.PodShape  # the distributed job's pod on one GPU node
    cost_per_hour_usd: float  # every accelerator node the stack runs, spares included
    # Spare training nodes (acceleratorNodeGroups[].spares): booted beside the world to replace a
    # failed node at once; their accelerators and their share of the cost per hour above.
    spare_nodes: int = 0
    spare_accelerators: int = 0
    spare_cost_per_hour_usd: float = 0.0
    # The serving plan of the `inference` section (None without one): components/k8s/serving.py and the
    # serving policies read it from here.
    inference: InferencePlan | None = None
    # How training and serving share the accelerators, per pool (supernode.core.pools): the Kueue
    # quotas and the pools-add-up policy read these figures. Empty for a local (CPU) plan.
    pools: list[Pool] = []
    # How the teams (supernode:teams) split each pool's training share (supernode.core.pools): their
    # ClusterQueues, ResourceQuotas and the pools-add-up policy read these. Empty without teams.
    teams: list[TeamPool] = []
    # A job's plan (supernode.core.jobs.job_plan): the team it is submitted as; None for the stack's own.
    team: str | None = None
    # The trainer pod's grace period (workload.terminationGraceS) and the least it may be: one step
    # (the slowest of the elastic layouts that fit), one checkpoint write and a margin
    # (supernode.core.pools), so a preempted, drained or terminated pod checkpoints before it is killed
    # (the checkpoint-termination-grace policy).
    termination_grace_s: int = 0
    termination_grace_needed_s: int = 0
    # The layout of every world the elastic job may run at (training.minNodes to the planned nodes;
    # a local plan: every world 1..local.nproc), the planned world last (supernode.core.estimate).
    layouts: list[Layout]

    @model_validator(mode="after")
    def _world_has_a_layout(self) -> Plan:
        got = [lay for lay in self.layouts if lay.world_size == self.world_size]
        if len(got) != 1 or got[0].step is None:
            raise ValueError(f"world_size {self.world_size}: needs exactly one costed layout in layouts")
        return self

    # -- the selected world's figures ---------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return next(lay for lay in self.layouts if lay.world_size == self.world_size)

    @property
    def nodes(self) -> int:
        """The training nodes of this world (one trainer pod each; a local plan: its ranks)."""
        return self.layout.nodes

    @property
    def parallel(self) -> Parallel:
        return self.layout.parallel  # type: ignore[return-value]  # a costed layout has one

    @property
    def degrees(self) -> Mesh:
        """The layout: rank order, groups, shard group (`parallel` holds the same degrees and the options)."""
        return self.parallel.degrees()

    @property
    def memory(self) -> cap.Memory:
        return self.layout.memory  # type: ignore[return-value]

    @property
    def memory_per_rank_gib(self) -> float:
        return self.layout.memory_per_rank_gib

    @property
    def fits(self) -> bool:
        """Memory per rank within the usable HBM: the memory-fit policy reads this, never recomputes it."""
        return self.layout.fits

    @property
    def over_by_gib(self) -> float:
        return self.layout.over_by_gib

    @property
    def micro_batches_per_step(self) -> int:
        """Gradient accumulation: global_batch / (micro_batch x dp), rounded up."""
        return self.layout.micro_batches_per_step

    @property
    def padded_micro_batches(self) -> int:
        return self.layout.padded_micro_batches

    @property
    def pipeline(self) -> cap.PipelineShape:
        return self.layout.pipeline  # type: ignore[return-value]

    @property
    def step(self) -> cap.StepTime:
        return self.layout.step  # type: ignore[return-value]

    @property
    def run_hours(self) -> float:
        """The run's hours: training.steps at this world's step time."""
        return self.training.steps * self.step.step_s / 3600

    @property
    def run_cost_usd(self) -> float:
        return self.cost_per_hour_usd * self.run_hours

    @property
    def min_nodes(self) -> int:
        """The fewest nodes the elastic job runs on (training.minNodes; the planned nodes when the
        job is not elastic): the PyTorchJob's minReplicas."""
        return self.nodes if self.local else self.layouts[0].nodes

    @property
    def hardware(self) -> InstanceType:
        return CATALOG[self.instance_type]

    def to_json(self) -> str:
        # A stack without teams serialises as it did before teams existed (its ConfigMap and hashes unchanged).
        empty = {k for k in ("teams", "team") if not getattr(self, k)}
        return self.model_dump_json(indent=2, exclude=empty or None)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.model_validate_json(text)

    @classmethod
    def read(cls, path: str | Path) -> Plan:
        """A plan file as the trainer and the gate read it (`--plan`): every unusable file is
        BadInput naming it and why, never a traceback."""
        where = f"--plan {path}"
        try:
            return cls.from_json(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise BadInput(f"{where}: file not found") from None
        except IsADirectoryError:
            raise BadInput(f"{where}: is a directory, not a plan file") from None
        except UnicodeDecodeError as e:
            raise BadInput(
                f"{where}: not UTF-8 text (byte {e.start}); give the JSON of `supernode plan --json --full`"
            ) from None
        except OSError as e:
            raise BadInput(f"{where}: cannot be read ({e.strerror})") from None
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            raise BadInput(f"{where}: not a valid plan: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None

    def for_world(self, world_size: int) -> Plan:
        """This plan at the world the job actually got: the same plan with `world_size` selecting that
        world's layout, and no suggestions (they are the planned world's). A world the plan has no
        layout for, or one whose layout cannot run, is BadInput naming it."""
        if world_size == self.world_size:
            return self
        worlds = [lay.world_size for lay in self.layouts]
        span = f"{min(worlds)}..{max(worlds)} ranks"
        e = next((lay for lay in self.layouts if lay.world_size == world_size), None)
        if e is None:
            raise BadInput(
                f"world size {world_size}: the plan has no elastic layout for it (its worlds: "
                f"{', '.join(map(str, worlds))}, {span}); "
                + ("run with at most local.nproc ranks" if self.local else "set training.minNodes to allow it")
            )
        if not e.fits:
            raise BadInput(f"world size {world_size}: no layout runs there (the plan's worlds {span}): {e.reason}")
        return self.model_copy(update={"world_size": world_size, "suggestions": []})

    def summary(self) -> dict:
        """The contract keys (docs/architecture.md §7) plus the headline figures."""
        return {
            "stack": self.stack,
            "world_size": self.world_size,
            "degrees": self.degrees.model_dump(),
            "memory_per_rank_gib": round(self.memory_per_rank_gib, 3),
            "hbm_gib": round(self.hbm_gib, 3),
            "fits": self.fits,
        }


def _training_hardware(cfg: StackConfig, calibration: cap.Calibration | None) -> InstanceType:
    """Mixed instance types are allowed; the plan is sized for the smallest GPU memory among them
    (a calibration must have been measured on that accelerator)."""
    hw = min((CATALOG[g.instance_type] for g in cfg.training_node_groups), key=lambda t: t.hbm_mib)
    if calibration is not None and calibration.accelerator != hw.accelerator:
        raise BadInput(
            f"calibration {calibration.path or ''}: measured on {calibration.accelerator} ({calibration.device}), "
            f"but the plan's GPUs are {hw.accelerator} ({hw.name}); run `supernode bench gpu "
            f"--calibration-out FILE` on a {hw.accelerator}"
        )
    return hw


def _smallest_domain(cfg: StackConfig, hw: InstanceType) -> tuple[str | None, int]:
    """(UltraServer type or None, its ranks): the smallest NVLink domain among the groups of `hw`'s type."""
    ultra = min(
        (g.ultra_server for g in cfg.training_node_groups if g.instance_type == hw.name),
        key=lambda u: nvlink_domain_gpus(hw.name, u),
    )
    return ultra, nvlink_domain_gpus(hw.name, ultra)


def _plan(
    stack: str, cfg: StackConfig, local: bool, calibration: cap.Calibration | None = None, device: str | None = None
) -> Plan:
    hw = _training_hardware(cfg, calibration)
    device = device or hw.torch_device
    m, p, t = cfg.model, cfg.parallel.computed_on(device), cfg.training
    world = cfg.local.nproc if local else cfg.accelerators
    ultra, domain = (None, world) if local else _smallest_domain(cfg, hw)  # a CPU run: one host, one "domain"
    leaving = [] if local else domain_rules(p, hw, domain, ultra or f"one {hw.name}")
    if leaving:
        raise BadInput(str(leaving[0]))
    params = cap.param_counts(m)
    worlds = (
        local_worlds(world) if local else planned_worlds(t.min_nodes or cfg.nodes, cfg.nodes, hw.accelerators, world)
    )
    # Each world estimated once (a CPU run: one host, the domain is its world).
    layouts = [estimate(m, p, t, hw, params, n, w, w if local else domain, calibration) for n, w in worlds]
    planned = layouts[-1]
    if planned.step is None:
        raise BadInput(f"{NAMESPACE}:parallel: {planned.reason}")
    ckpt = cap.checkpoint_io(params, t, cfg.storage.fsx)
    serving = None if local else build_inference_plan(cfg, params, hw)
    pools = (
        []
        if local
        else build_pools(
            cfg, world // hw.ranks_per_chip, layouts[0].world_size // hw.ranks_per_chip, hw.accelerator, serving
        )
    )
    return Plan(
        stack=stack,
        local=local,
        device=device,
        instance_type=hw.name,
        accelerators_per_node=hw.accelerators,
        world_size=world,
        model=m,
        training=t,
        params=params,
        flops_per_token=cap.flops_per_token(m, params),
        hbm_gib=hw.hbm_gib,
        usable_hbm_gib=cap.usable_hbm_bytes(p, hw) / GIB,
        suggestions=[]
        if planned.fits or local
        else suggest(m, p, t, hw, params, domain=domain, calibration=calibration),
        calibration=calibration,
        topology=Topology(
            ultra_server=ultra,
            domain_gpus=domain,
            nodes_per_domain=max(1, domain // hw.accelerators),
            domain_hbm_gib=domain * hw.hbm_gib,
            replica_state_gib=cap.ADAM_STATE_BYTES * params.total / GIB,
        ),
        checkpoint=ckpt,
        gate_floor_gbytes_s=gate_floor_gbytes_s(hw.name, cfg.workload.gate_min_fraction),
        pod=cap.PodShape.for_node(hw, cfg.workload.hugepages_2mi_gib),
        cost_per_hour_usd=cap.cost_per_hour(_nodes(cfg), CATALOG),
        spare_nodes=sum(g.spares for g in cfg.training_node_groups),
        spare_accelerators=sum(g.spares * CATALOG[g.instance_type].accelerators for g in cfg.training_node_groups),
        spare_cost_per_hour_usd=cap.cost_per_hour(_nodes(cfg, spares_only=True), CATALOG),
        inference=serving,
        pools=pools,
        teams=[] if local else build_team_pools(cfg, pools),
        termination_grace_s=cfg.workload.termination_grace_s,
        # the slowest step the job may run: an elastic job preempted at a smaller world finishes that step
        termination_grace_needed_s=termination_grace_needed_s(
            max(lay.step_s for lay in layouts if lay.fits or lay is planned), ckpt.write_seconds
        ),
        layouts=layouts,
    )


def _nodes(cfg: StackConfig, spares_only: bool = False) -> Counter:
    """Instances by type the stack pays for: every accelerator group's nodes and spares (or the spares alone)."""
    c: Counter = Counter()
    for g in cfg.accelerator_node_groups:
        c[g.instance_type] += g.spares if spares_only else g.instances
    return c


def build_plan(
    stack: str, cfg: StackConfig, calibration: cap.Calibration | None = None, root: str | Path = "."
) -> Plan:
    """The stack's plan; its step time on `calibration` if given, else on the file the stack's
    `supernode:calibration` names (relative to the project directory `root`), else uncalibrated."""
    if calibration is None and cfg.calibration:
        calibration = cap.Calibration.read(Path(root) / cfg.calibration, f"{NAMESPACE}:calibration")
    return _plan(stack, cfg, local=False, calibration=calibration)


def build_local_plan(stack: str, cfg: StackConfig, nproc: int | None = None, device: str = "cpu") -> Plan:
    """The same plan scaled down by the stack's `local` section, for a run of nproc ranks on one
    machine's `device` (default: local.nproc on CPU; another count rescales the local dpShard, see
    `with_local_nproc`)."""
    if nproc is not None:
        cfg = with_local_nproc(cfg, nproc)
    return _plan(stack, cfg.local_config(), local=True, device=device)
