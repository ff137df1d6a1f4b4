"""The Plan: the one object that sizes the hardware, configures the job and is checked by policy.

Built once from a StackConfig (`build_plan`), serialised once (`Plan.to_json`); the Kubernetes
ConfigMap, the trainer and the policy pack all read that JSON. Nothing re-derives the layout.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from . import capacity as cap
from .catalog import CATALOG, GIB, InstanceType, gate_floor_gbytes_s, nvlink_domain_gpus
from .config import NAMESPACE, Model, Parallel, StackConfig, Training, with_local_nproc
from .elastic import ElasticLayout, costed, elastic_layouts, local_worlds, planned_worlds
from .errors import BadInput
from .inference import InferencePlan, build_inference_plan
from .layout import domain_rules
from .mesh import Mesh
from .pools import Pool, build_pools, termination_grace_needed_s
from .topology import GroupPlacement, place

# In the cluster the Plan travels as this ConfigMap key, mounted read-only in this directory: the
# workload writes it, the trainer reads it (`--plan PLAN_MOUNT_PATH`), the policy pack checks it.
PLAN_CONFIGMAP_KEY = "plan.json"
PLAN_MOUNT_DIR = "/etc/supernode"
PLAN_MOUNT_PATH = f"{PLAN_MOUNT_DIR}/{PLAN_CONFIGMAP_KEY}"


class Topology(BaseModel):
    """The NVLink domain and where the mesh lands on it (supernode.core.topology)."""

    model_config = ConfigDict(frozen=True)
    ultra_server: str | None  # e.g. u-p6e-gb200x72; None: the domain is one instance
    domain_gpus: int
    nodes_per_domain: int
    domains: int  # NVLink domains the job spans (world / domain_gpus, rounded up)
    # The domain's aggregate HBM: the "global address space" one job's ranks on it share.
    domain_hbm_gib: float
    # One replica's training state (16 B per parameter) and the domains its shard group
    # (dp_shard x tp x pp ranks) spans: that state must fit the aggregate usable HBM of the shard
    # group's GPUs (checklist item 2, the global address space, beside the per-GPU fit).
    replica_state_gib: float
    replica_domains: int
    replica_fits: bool
    placement: list[GroupPlacement]

    def group(self, dim: str) -> GroupPlacement:
        return next(g for g in self.placement if g.dim == dim)


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True)

    stack: str
    local: bool  # True: the CPU layout from the stack's `local` section
    instance_type: str
    nodes: int
    accelerators_per_node: int
    world_size: int
    degrees: Mesh  # the layout: rank order, groups, shard group (`parallel` holds the same degrees and the options)
    model: Model
    parallel: Parallel
    training: Training
    # capacity figures
    params: cap.ParamCounts
    flops_per_token: float
    memory: cap.Memory
    memory_per_rank_gib: float
    hbm_gib: float
    usable_hbm_gib: float  # HBM less parallel.hbm_headroom: what a rank may plan to use
    fits: bool  # memory_per_rank_gib <= usable_hbm_gib; the memory-fit policy reads this, never recomputes it
    over_by_gib: float  # how far over the usable HBM the estimate is (0 when it fits)
    suggestions: list[cap.Suggestion]
    micro_batches_per_step: int  # gradient accumulation: global_batch / (micro_batch x dp), rounded up
    # Micro-batch slots (over all dp ranks) of the last accumulation round beyond the global batch,
    # run with zero weight: 0 at the planned world, where dp divides the batch (supernode.core.elastic).
    padded_micro_batches: int = 0
    # pp, the schedule, virtual stages, the layers of each stage (the trainer builds its stages from
    # these), the bubble, the in-flight micro-batches and the stage-to-stage volume.
    pipeline: cap.PipelineShape
    step: cap.StepTime
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
    run_hours: float
    run_cost_usd: float
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
    # The trainer pod's grace period (workload.terminationGraceS) and the least it may be: one step
    # (the slowest of the elastic layouts that fit), one checkpoint write and a margin
    # (supernode.core.pools), so a preempted, drained or terminated pod checkpoints before it is killed
    # (the checkpoint-termination-grace policy).
    termination_grace_s: int = 0
    termination_grace_needed_s: int = 0
    # The layout of every world the elastic job may run at (training.minNodes to the planned nodes;
    # a local plan: every world 1..local.nproc), the planned world included with the plan's own
    # figures (supernode.core.elastic); `for_world` picks one.
    elastic: list[ElasticLayout] = []

    @property
    def min_nodes(self) -> int:
        """The fewest nodes the elastic job runs on (training.minNodes; the planned nodes when the
        job is not elastic): the PyTorchJob's minReplicas."""
        return self.nodes if self.local or not self.elastic else self.elastic[0].nodes

    @property
    def hardware(self) -> InstanceType:
        return CATALOG[self.instance_type]

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

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
        """This plan at the world the job actually got: itself at the planned world, else a copy with
        that world's elastic layout (degrees, parallel, accumulation and padding, pipeline, memory,
        fit, step time, placement) and the run's hours and cost at its step time; no suggestions (they
        are the planned world's). Every other field describes the stack, the same at any world
        (tests/core/test_elastic.py holds the split). A world the plan has no layout for is BadInput naming it."""
        if world_size == self.world_size:
            return self
        worlds = [e.world_size for e in self.elastic]
        span = f"{min(worlds)}..{max(worlds)} ranks" if worlds else "none"
        e = next((e for e in self.elastic if e.world_size == world_size), None)
        if e is None:
            raise BadInput(
                f"world size {world_size}: the plan has no elastic layout for it (its worlds: "
                f"{', '.join(map(str, worlds)) or 'none'}, {span}); "
                + ("run with at most local.nproc ranks" if self.local else "set training.minNodes to allow it")
            )
        if not e.fits or e.parallel is None or e.pipeline is None or e.memory is None or e.step is None:
            raise BadInput(f"world size {world_size}: no layout runs there (the plan's worlds {span}): {e.reason}")
        usable = self.usable_hbm_gib * GIB
        t = self.topology
        shard_group = e.parallel.shard_group
        topology = t.model_copy(
            update=dict(
                domains=-(-world_size // t.domain_gpus),
                replica_domains=-(-shard_group // t.domain_gpus),
                replica_fits=cap.ADAM_STATE_BYTES * self.params.total <= shard_group * usable,
                placement=place(e.parallel, t.domain_gpus),
            )
        )
        return self.model_copy(
            update=dict(
                nodes=self.nodes if self.local else e.nodes,
                world_size=world_size,
                degrees=e.degrees,
                parallel=e.parallel,
                micro_batches_per_step=e.micro_batches_per_step,
                padded_micro_batches=e.padded_micro_batches,
                pipeline=e.pipeline,
                memory=e.memory,
                memory_per_rank_gib=e.memory_per_rank_gib,
                fits=e.fits,
                over_by_gib=max(0.0, e.memory_per_rank_gib - self.usable_hbm_gib),
                step=e.step,
                topology=topology,
                run_hours=(hours := run_hours(self.training, e.step.step_s)),
                run_cost_usd=self.cost_per_hour_usd * hours,
                suggestions=[],  # layouts of the planned world, offered where it does not fit
            )
        )

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


def _plan(stack: str, cfg: StackConfig, local: bool, calibration: cap.Calibration | None = None) -> Plan:
    # Mixed instance types are allowed; the plan is sized for the smallest GPU memory among them,
    # and for the smallest NVLink domain among the groups of that type.
    hw = min((CATALOG[g.instance_type] for g in cfg.training_node_groups), key=lambda t: t.hbm_mib)
    if calibration is not None and calibration.accelerator != hw.accelerator:
        raise BadInput(
            f"calibration {calibration.path or ''}: measured on {calibration.accelerator} ({calibration.device}), "
            f"but the plan's GPUs are {hw.accelerator} ({hw.name}); run `supernode bench gpu "
            f"--calibration-out FILE` on a {hw.accelerator}"
        )
    m, p, t = cfg.model, cfg.parallel, cfg.training
    world = cfg.local.nproc if local else cfg.accelerators
    ultra = (
        None
        if local
        else min(
            (g.ultra_server for g in cfg.training_node_groups if g.instance_type == hw.name),
            key=lambda u: nvlink_domain_gpus(hw.name, u),
        )
    )
    domain = world if local else nvlink_domain_gpus(hw.name, ultra)  # a CPU run: one host, one "domain"
    # The estimate, one pass: each figure computed once and handed on.
    params = cap.param_counts(m)
    pipe = cap.pipeline(m, p, t)  # micro-batches per step, stages, bubble: one figure for all readers
    mem = cap.memory(m, p, t, params, pipe)
    st = cap.step_time(m, p, t, hw, params, pipe, domain, calibration)
    usable = cap.usable_hbm_bytes(p, hw)
    fits = mem.total <= usable
    ckpt = cap.checkpoint_io(params, t, cfg.storage.fsx)
    hours = run_hours(t, st.step_s)
    per_hour, total = cap.hours_cost(_nodes(cfg), CATALOG, hours)
    spare_per_hour, _ = cap.hours_cost(_nodes(cfg, spares_only=True), CATALOG, hours)
    shard_group = p.shard_group
    replica_domains = -(-shard_group // domain)
    replica_state = cap.ADAM_STATE_BYTES * params.total
    topology = Topology(
        ultra_server=ultra,
        domain_gpus=domain,
        nodes_per_domain=max(1, domain // hw.accelerators),
        domains=-(-world // domain),
        domain_hbm_gib=domain * hw.hbm_gib,
        replica_state_gib=replica_state / GIB,
        replica_domains=replica_domains,
        replica_fits=replica_state <= shard_group * usable,
        placement=place(p, domain),
    )
    leaving = [] if local else domain_rules(p, hw, domain, topology.ultra_server or f"one {hw.name}")
    if leaving:
        raise BadInput(str(leaving[0]))
    serving = None if local else build_inference_plan(cfg, params, hw)
    worlds = (
        local_worlds(world) if local else planned_worlds(t.min_nodes or cfg.nodes, cfg.nodes, hw.accelerators, world)
    )
    # The planned world's layout is the plan's own estimate; the other worlds are estimated like it.
    elastic = elastic_layouts(m, p, t, hw, params, worlds[:-1], None if local else domain, calibration)
    elastic.append(costed(m, p, t, hw, *worlds[-1], pipe, mem, st))
    return Plan(
        stack=stack,
        local=local,
        instance_type=hw.name,
        nodes=cfg.nodes,
        accelerators_per_node=hw.accelerators,
        world_size=world,
        degrees=p.degrees(),
        model=m,
        parallel=p,
        training=t,
        params=params,
        flops_per_token=cap.flops_per_token(m, params),
        memory=mem,
        memory_per_rank_gib=mem.total_gib,
        hbm_gib=hw.hbm_gib,
        usable_hbm_gib=usable / GIB,
        fits=fits,
        over_by_gib=max(0.0, (mem.total - usable) / GIB),
        suggestions=[] if fits or local else cap.suggest(m, p, t, hw, params, domain=domain, calibration=calibration),
        micro_batches_per_step=pipe.micro_batches,
        pipeline=pipe,
        step=st,
        calibration=calibration,
        topology=topology,
        checkpoint=ckpt,
        gate_floor_gbytes_s=gate_floor_gbytes_s(hw.name, cfg.workload.gate_min_fraction),
        pod=cap.PodShape.for_node(hw, cfg.workload.hugepages_2mi_gib),
        cost_per_hour_usd=per_hour,
        run_hours=hours,
        run_cost_usd=total,
        spare_nodes=sum(g.spares for g in cfg.training_node_groups),
        spare_accelerators=sum(g.spares * CATALOG[g.instance_type].accelerators for g in cfg.training_node_groups),
        spare_cost_per_hour_usd=spare_per_hour,
        inference=serving,
        pools=[]
        if local
        else build_pools(
            cfg, world // hw.ranks_per_chip, elastic[0].world_size // hw.ranks_per_chip, hw.accelerator, serving
        ),
        termination_grace_s=cfg.workload.termination_grace_s,
        # the slowest step the job may run: an elastic job preempted at a smaller world finishes that step
        termination_grace_needed_s=termination_grace_needed_s(
            max(e.step_s for e in elastic if e.fits or e is elastic[-1]), ckpt.write_seconds
        ),
        elastic=elastic,
    )


def run_hours(t: Training, step_s: float) -> float:
    """The run's hours: training.steps at `step_s` a step."""
    return t.steps * step_s / 3600


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


def build_local_plan(stack: str, cfg: StackConfig, nproc: int | None = None) -> Plan:
    """The same plan scaled down by the stack's `local` section, for a CPU run with nproc ranks
    (default: local.nproc; another count rescales the local dpShard, see `with_local_nproc`)."""
    if nproc is not None:
        cfg = with_local_nproc(cfg, nproc)
    return _plan(stack, cfg.local_config(), local=True)
