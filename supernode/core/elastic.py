"""Elastic layouts: the plan's layout for every world the job may run at (issue 26, item 2).

An elastic PyTorchJob runs on any node count from `training.minNodes` to the planned nodes; a local
(CPU) plan on any world from 1 to `local.nproc` (one rank per "node"). For each, one layout, derived
from the planned one by one rule (docs/architecture.md, "Elastic training and spare nodes"):

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

Memory, step time and fit come from the same capacity functions as the plan's own layout, on the
padded batch (the padded micro-batches cost time); a world with no valid layout, or one that does
not fit, is listed with `fits=False` and the reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict

from . import capacity as cap
from .catalog import GIB, InstanceType
from .config import Model, Parallel, Training
from .layout import domain_rules, layout_rules
from .mesh import Mesh


class ElasticLayout(BaseModel):
    """One world the job may run at and its layout; `parallel` and the figures are None/0 when the
    world has no valid layout (`reason` says why)."""

    model_config = ConfigDict(frozen=True)

    nodes: int  # training nodes (a local plan: ranks, one per "node")
    world_size: int
    parallel: Parallel | None  # the planned Parallel, options kept, degrees changed
    degrees: Mesh | None
    micro_batches_per_step: int  # accumulation rounds per step on each dp rank
    padded_micro_batches: int  # micro-batch slots (over all dp ranks) of the last round beyond the global batch
    pipeline: cap.PipelineShape | None
    memory: cap.Memory | None
    step: cap.StepTime | None
    memory_per_rank_gib: float
    fits: bool  # a valid layout whose memory per rank is within the usable HBM
    step_s: float
    tokens_per_s: float  # the global batch's tokens (padding not counted) per second
    reason: str | None = None  # why the world cannot run (None when it fits)


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


def layout_for(
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
) -> ElasticLayout:
    """The layout of `world` ranks on `nodes` nodes derived from the planned `p`, costed like the
    plan: of the candidates (`replicas`, default every dp_replicate dividing the planned one and the
    world) the one that fits with the shortest step, else the first candidate's reason."""
    none = dict(
        nodes=nodes,
        world_size=world,
        parallel=None,
        degrees=None,
        micro_batches_per_step=0,
        padded_micro_batches=0,
        pipeline=None,
        memory=None,
        step=None,
        memory_per_rank_gib=0.0,
        fits=False,
        step_s=0.0,
        tokens_per_s=0.0,
    )

    def candidate(rep: int | None) -> ElasticLayout:
        q = derive(p, world, m.experts, rep)
        if isinstance(q, str):
            return ElasticLayout(**none, reason=q)
        padded = padded_training(t, q.dp)
        if q.pp > 1 and padded.global_batch != t.global_batch:
            return ElasticLayout(
                **none | dict(parallel=q, degrees=q.degrees()),
                reason=f"pipeline parallel (pp {q.pp}) runs no zero-weight micro-batches: dp {q.dp} does not divide "
                f"the global batch's {t.global_batch // t.micro_batch} micro-batches",
            )
        issues = layout_rules(m, q, padded, world, domain) + domain_rules(q, hw, domain)
        if issues:
            return ElasticLayout(**none | dict(parallel=q, degrees=q.degrees()), reason=str(issues[0]))
        pipe = cap.pipeline(m, q, padded)
        mem = cap.memory(m, q, padded, pc, pipe)
        st = cap.step_time(m, q, padded, hw, pc, pipe, domain, calibration)
        # The padded micro-batches are computed but teach nothing: MFU counts the global batch's work only.
        st = st.model_copy(update={"mfu": st.mfu * t.global_batch / padded.global_batch})
        return costed(m, q, t, hw, nodes, world, pipe, mem, st)

    fixed = p.tp * p.pp
    reps = replicas or [r for r in range(p.dp_replicate, 0, -1) if p.dp_replicate % r == 0 and world % (fixed * r) == 0]
    options = [candidate(rep) for rep in reps or [None]]
    fitting = [o for o in options if o.fits]
    return min(fitting, key=lambda o: o.step_s) if fitting else options[0]


def costed(
    m: Model,
    q: Parallel,
    t: Training,
    hw: InstanceType,
    nodes: int,
    world: int,
    pipe: cap.PipelineShape,
    mem: cap.Memory,
    st: cap.StepTime,
) -> ElasticLayout:
    """The layout `q` of `world` ranks with its estimate (the plan hands in its own for the planned world)."""
    padded = padded_training(t, q.dp)
    usable = cap.usable_hbm_bytes(q, hw)
    fits = mem.total <= usable
    return ElasticLayout(
        nodes=nodes,
        world_size=world,
        parallel=q,
        degrees=q.degrees(),
        micro_batches_per_step=pipe.micro_batches,
        padded_micro_batches=(padded.global_batch - t.global_batch) // t.micro_batch,
        pipeline=pipe,
        memory=mem,
        step=st,
        memory_per_rank_gib=mem.total_gib,
        fits=fits,
        step_s=st.step_s,
        tokens_per_s=t.global_batch * m.seq_len / st.step_s,
        reason=None
        if fits
        else f"{mem.total_gib:.1f} GiB per rank > the usable {usable / GIB:.1f} GiB of {hw.hbm_gib:.0f} GiB HBM",
    )


def elastic_layouts(
    m: Model,
    p: Parallel,
    t: Training,
    hw: InstanceType,
    pc: cap.ParamCounts,
    worlds: Iterable[tuple[int, int]],
    domain: int | None,
    calibration: cap.Calibration | None = None,
) -> list[ElasticLayout]:
    """The layout of every (nodes, world) in `worlds`, in that order; `domain`: the NVLink domain's
    ranks, None for a CPU run (one host: the domain is the world)."""
    return [layout_for(m, p, t, hw, pc, n, w, domain or w, calibration) for n, w in worlds]


def planned_worlds(min_nodes: int, nodes: int, ranks_per_node: int, world: int) -> list[tuple[int, int]]:
    """(nodes, world) from `min_nodes` to the planned `nodes`, the last one the planned `world`."""
    return [(n, n * ranks_per_node) for n in range(min_nodes, nodes)] + [(nodes, world)]


def local_worlds(nproc: int) -> list[tuple[int, int]]:
    """A CPU run's worlds: every rank count 1..nproc, one rank per "node"."""
    return [(w, w) for w in range(1, nproc + 1)]
