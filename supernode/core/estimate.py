"""The layout of a world and its estimate: one `Layout` type, one `estimate()` for every reader.

The plan's own world, every world its elastic job may run at, and every candidate the layout search
tries (supernode.core.search) are costed by `cost`: degrees, accumulation and padding, pipeline,
memory, fit, step time and placement on the NVLink domains, each from the capacity functions once.

An elastic PyTorchJob runs on any node count from `training.minNodes` to the planned nodes; a local
(CPU) plan on any world from 1 to `local.nproc` (one rank per "node"). `estimate` derives each
world's layout from the planned one by one rule (docs/architecture.md, "Elastic training and spare
nodes"):

- tp and pp are kept (with them their NVLink-domain placement and the pipeline's stages);
- dp_replicate is the planned one or a divisor of it (tp x pp x dp_replicate must divide the
  world), and dp_shard fills the rest: world / (tp x pp x dp_replicate); of these candidates the
  one that fits with the shortest step wins (fewer replicas can mean a larger EP group: prod on 9
  nodes runs dp_replicate 1 x dp_shard 72 with ep 8, not 2 x 36 with ep 4);
- ep is the largest divisor of dp_shard x tp that divides the experts and is at most the planned
  ep: a smaller world may have fewer ranks per replica than the planned EP group, and a group
  never grows past the planned one, so it stays inside the domain the plan placed it in;
- the global batch is kept: each step runs ceil(global_batch / (micro_batch x dp)) accumulation
  rounds, and the micro-batch slots of the last round beyond the global batch
  (`padded_micro_batches`, over all dp ranks) run with zero weight, so every rank runs the same
  forwards and backwards (the FSDP collectives stay matched) and the step's gradient is exactly
  the global batch's. Pipeline parallelism runs no padding (its schedule weighs every
  micro-batch's auxiliary loss alike on every stage), so with pp > 1 a world whose dp does not
  divide the global batch's micro-batches has no layout.

Memory and step time are of the padded batch (the padded micro-batches cost time); a world with
no valid layout, or one that does not fit, has `fits=False` and the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from . import capacity as cap
from .catalog import GIB, InstanceType
from .config import Model, Parallel, Training
from .layout import domain_rules, layout_rules
from .mesh import Mesh
from .topology import GroupPlacement, place


class Layout(BaseModel):
    """One world and its layout. `parallel` is None when no layout can be derived for the world, and
    the figures are None/0 when it is not valid (`reason` says why)."""

    model_config = ConfigDict(frozen=True)

    nodes: int  # training nodes (a local plan: ranks, one per "node")
    world_size: int
    parallel: Parallel | None  # the planned Parallel, options kept, degrees those of this world
    micro_batches_per_step: int = 0  # accumulation rounds per step on each dp rank
    # Micro-batch slots (over all dp ranks) of the last round beyond the global batch, run with zero
    # weight: 0 at the planned world, where dp divides the batch.
    padded_micro_batches: int = 0
    # pp, the schedule, virtual stages, the layers of each stage (the trainer builds its stages from
    # these), the bubble, the in-flight micro-batches and the stage-to-stage volume.
    pipeline: cap.PipelineShape | None = None
    memory: cap.Memory | None = None
    step: cap.StepTime | None = None
    memory_per_rank_gib: float = 0.0
    fits: bool = False  # a valid layout whose memory per rank is within the usable HBM
    over_by_gib: float = 0.0  # how far over the usable HBM the estimate is (0 when it fits)
    step_s: float = 0.0
    tokens_per_s: float = 0.0  # the global batch's tokens (padding not counted) per second
    # Where each mesh dimension's groups land on the NVLink domains (supernode.core.topology).
    placement: list[GroupPlacement] = []
    domains: int = 0  # NVLink domains the world spans (rounded up)
    # The domains one replica's shard group (dp_shard x tp x pp ranks) spans, and whether its training
    # state fits their usable HBM (checklist item 2, the global address space, beside the per-GPU fit).
    replica_domains: int = 0
    replica_fits: bool = False
    reason: str | None = None  # why the world cannot run (None when it fits)

    @property
    def degrees(self) -> Mesh | None:
        """The layout: rank order, groups, shard group."""
        return None if self.parallel is None else self.parallel.degrees()

    def group(self, dim: str) -> GroupPlacement:
        return next(g for g in self.placement if g.dim == dim)


def rounds(t: Training, dp: int) -> int:
    """Accumulation rounds per step that cover the global batch over `dp` data-parallel ranks."""
    return -(-t.global_batch // (t.micro_batch * dp))


def padded_training(t: Training, dp: int) -> Training:
    """`t` with the global batch a world of `dp` data-parallel ranks runs, padding included: what the
    capacity functions and the layout validator see at that world (the trainer weights the padded
    micro-batches zero, so the batch it learns from stays `t.global_batch`)."""
    return t.model_copy(update={"global_batch": rounds(t, dp) * t.micro_batch * dp})


def derive(p: Parallel, world: int, experts: int, rep: int | None = None) -> Parallel | str:
    """The planned layout `p` resized to `world` ranks by the rule above with `rep` data-parallel
    replicas (default: the planned ones where they divide the world, else 1), or why it cannot be."""
    fixed = p.tp * p.pp
    if world % fixed:
        return f"tp*pp = {p.tp}*{p.pp} = {fixed} does not divide the world {world}"
    if rep is None:
        rep = p.dp_replicate if world % (fixed * p.dp_replicate) == 0 else 1
    shard = world // (fixed * rep)
    ep = max(d for d in range(1, min(p.ep, shard * p.tp) + 1) if (shard * p.tp) % d == 0 and experts % d == 0)
    return p.model_copy(update={"dp_replicate": rep, "dp_shard": shard, "ep": ep})


def cost(
    m: Model,
    q: Parallel,
    t: Training,
    hw: InstanceType,
    pc: cap.ParamCounts,
    nodes: int,
    domain: int,
    calibration: cap.Calibration | None = None,
    fitting_only: bool = False,
) -> Layout:
    """The layout `q` (its world: q.world_size on `nodes` nodes) on NVLink domains of `domain` ranks,
    checked by the layout validator and costed: the one place a layout's figures are computed.
    `fitting_only` (the layout search): a layout over the usable HBM is returned with its memory and
    reason but no step time, which only a layout that fits needs there."""
    world = q.world_size
    padded = padded_training(t, q.dp)
    if q.pp > 1 and padded.global_batch != t.global_batch:
        return Layout(
            nodes=nodes,
            world_size=world,
            parallel=q,
            reason=f"pipeline parallel (pp {q.pp}) runs no zero-weight micro-batches: dp {q.dp} does not divide "
            f"the global batch's {t.global_batch // t.micro_batch} micro-batches",
        )
    issues = layout_rules(m, q, padded, world, domain) + domain_rules(q, hw, domain)
    if issues:
        return Layout(nodes=nodes, world_size=world, parallel=q, reason=str(issues[0]))
    pipe = cap.pipeline(m, q, padded)
    mem = cap.memory(m, q, padded, pc, pipe)
    usable = cap.usable_hbm_bytes(q, hw)
    fits = mem.total <= usable
    over = f"{mem.total_gib:.1f} GiB per rank > the usable {usable / GIB:.1f} GiB of {hw.hbm_gib:.0f} GiB HBM"
    if fitting_only and not fits:
        return Layout(
            nodes=nodes, world_size=world, parallel=q, memory=mem, memory_per_rank_gib=mem.total_gib, reason=over
        )
    st = cap.step_time(m, q, padded, hw, pc, pipe, domain, calibration)
    # The padded micro-batches are computed but teach nothing: MFU counts the global batch's work only.
    st = st.model_copy(update={"mfu": st.mfu * t.global_batch / padded.global_batch})
    shard_group = q.shard_group
    return Layout(
        nodes=nodes,
        world_size=world,
        parallel=q,
        micro_batches_per_step=pipe.micro_batches,
        padded_micro_batches=(padded.global_batch - t.global_batch) // t.micro_batch,
        pipeline=pipe,
        memory=mem,
        step=st,
        memory_per_rank_gib=mem.total_gib,
        fits=fits,
        over_by_gib=max(0.0, (mem.total - usable) / GIB),
        step_s=st.step_s,
        tokens_per_s=t.global_batch * m.seq_len / st.step_s,
        placement=place(q, domain),
        domains=-(-world // domain),
        replica_domains=-(-shard_group // domain),
        replica_fits=cap.ADAM_STATE_BYTES * pc.total <= shard_group * usable,
        reason=None if fits else over,
    )


def estimate(
    m: Model,
    p: Parallel,
    t: Training,
    hw: InstanceType,
    pc: cap.ParamCounts,
    nodes: int,
    world: int,
    domain: int,
    calibration: cap.Calibration | None = None,
    replicas: Sequence[int] | None = None,
) -> Layout:
    """The layout of `world` ranks on `nodes` nodes for the planned layout `p`: `p` itself at its own
    world; elsewhere derived by the rule above, of the candidates (`replicas`, default every
    dp_replicate dividing the planned one and the world) the one that fits with the shortest step,
    else the first candidate's reason."""
    if world == p.world_size and replicas is None:
        return cost(m, p, t, hw, pc, nodes, domain, calibration)
    fixed = p.tp * p.pp
    reps = replicas or [r for r in range(p.dp_replicate, 0, -1) if p.dp_replicate % r == 0 and world % (fixed * r) == 0]
    options = []
    for rep in reps or [None]:
        q = derive(p, world, m.experts, rep)
        options.append(
            Layout(nodes=nodes, world_size=world, parallel=None, reason=q)
            if isinstance(q, str)
            else cost(m, q, t, hw, pc, nodes, domain, calibration)
        )
    fitting = [o for o in options if o.fits]
    return min(fitting, key=lambda o: o.step_s) if fitting else options[0]


def planned_worlds(min_nodes: int, nodes: int, ranks_per_node: int, world: int) -> list[tuple[int, int]]:
    """(nodes, world) from `min_nodes` to the planned `nodes`, the last one the planned `world`."""
    return [(n, n * ranks_per_node) for n in range(min_nodes, nodes)] + [(nodes, world)]


def local_worlds(nproc: int) -> list[tuple[int, int]]:
    """A CPU run's worlds: every rank count 1..nproc, one rank per "node"."""
    return [(w, w) for w in range(1, nproc + 1)]
