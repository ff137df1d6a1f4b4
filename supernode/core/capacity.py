"""Capacity planner: parameters, per-rank memory, FLOPs, step time, checkpoint I/O and cost.

Pure arithmetic over the config and the catalog (no torch), so every figure can be checked by hand
(tests/core/test_capacity.py does). Conventions, chosen to match how the trainer lays things
out (docs/architecture.md §6):
- FSDP2 mixed precision keeps fp32 sharded master parameters, fp32 gradients and two fp32 Adam
  moments: 16 bytes per *sharded* parameter. Compute copies are all-gathered in the compute dtype.
- Non-expert weights are split by tp (norms and the router are replicated), then by pp (layers),
  then sharded by FSDP over dp_shard. Expert weights are split by ep and FSDP-sharded over
  dp_shard*tp/ep, so each rank holds experts/(dp_shard*tp) of them.
- Activations are itemised per token per layer (see `activation_terms`); no sequence parallel.
- PipelineShape (`pipeline`): stages by layer (`layout.stage_layers`), the busiest rank is pp rank 0
  (the most micro-batches in flight); the bubble is (pp-1)/(m*v + pp-1) of a step for m
  micro-batches per step and v virtual stages per rank.
- Step time (`step_time`) is the time as the trainer runs it: the recomputation its activation
  checkpointing mode does, and only the communication it overlaps by design credited as hidden
  (each term names the trainer code path it models). Efficiencies come from a `Calibration` that
  `bench gpu` measured, or else from the uncalibrated defaults below (`UNCALIBRATED` says which).

The estimate is one pass: `param_counts` (per model) -> `pipeline` (per layout) -> `memory` and
`step_time`, each taking what the steps before computed; `supernode.core.estimate.cost` runs it once
per layout (the plan's, each elastic world's, each candidate of `supernode.core.search`) with the
plan's counts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .catalog import GIB, InstanceType
from .config import FsxConfig, Model, Parallel, Training
from .errors import BadInput
from .layout import stage_layers
from .topology import (
    GroupPlacement,
    Link,
    all_to_all_seconds,
    group_span,
    inside_chip,
    nodes_spanned,
    place,
    ring_seconds,
    scale_up_link,
)

ADAM_STATE_BYTES = 16  # fp32 master + fp32 grad + 2 fp32 moments, per sharded parameter
CHECKPOINT_BYTES = 12  # fp32 master + 2 moments (gradients are not saved)
RUNTIME_RESERVE_BYTES = int(1.5 * GIB)  # CUDA context, NCCL/EFA buffers, allocator slack
# Uncalibrated defaults, used where no `Calibration` gives a measured figure:
MATMUL_EFFICIENCY = 0.55  # fraction of the dense bf16 peak the step's GEMM mix reaches
NVLINK_EFFICIENCY = 1.0  # fraction of the catalog's NVLink bandwidth a collective reaches
EFA_EFFICIENCY = 1.0  # fraction of the catalog's EFA bandwidth a collective reaches
# What a plan without a calibration rests on, and where the default comes from (printed by `supernode plan`).
UNCALIBRATED = (
    f"uncalibrated estimate: compute at {MATMUL_EFFICIENCY:.0%} of the GPU's dense bf16 peak (the top of "
    "published training MFU: MegaScale, arXiv:2402.15627, 55.2% on a dense 175B model; NVIDIA's NeMo "
    "AutoModel performance summary shows MoE pretraining on DGX-H100 in BF16 at about 330 model "
    "TFLOP/s per GPU, ~34% of the 989 TFLOP/s peak, communication included), NVLink and EFA at their "
    "catalog bandwidth (an upper bound); measure them with `supernode bench gpu --calibration-out FILE`"
)
FSX_INCREMENT_GIB = 2400
AC_MODES = ("none", "selective", "full")  # activation checkpointing, least recomputation first


class ParamCounts(BaseModel):
    embedding: int
    head: int
    attention: int  # all layers: q, k, v, o projections
    norms: int  # all RMSNorm weights incl. the final one
    router: int
    experts: int  # routed experts, all layers
    shared_experts: int
    dense_ffn: int
    total: int
    active: int  # per token: everything but the embedding lookup and the unused experts


def param_counts(m: Model) -> ParamCounts:
    d, hd = m.dim, m.head_dim
    q_dim, kv_dim = m.heads * hd, m.kv_heads * hd
    moe, dense = m.moe_layers, m.layers - m.moe_layers
    embedding = m.vocab * d
    head = 0 if m.tie_embeddings else m.vocab * d
    attention = m.layers * (d * q_dim + 2 * d * kv_dim + q_dim * d)
    norms = m.layers * 2 * d + d + (m.layers * 2 * hd if m.qk_norm else 0)  # + per-head q/k norms
    router = moe * d * m.experts
    experts = moe * m.experts * 3 * d * m.expert_hidden
    shared = moe * m.shared_experts * 3 * d * m.expert_hidden
    dense_ffn = dense * 3 * d * m.dense_hidden
    total = embedding + head + attention + norms + router + experts + shared + dense_ffn
    unused = moe * (m.experts - m.top_k) * 3 * d * m.expert_hidden
    active = total - embedding - unused + (embedding if m.tie_embeddings else 0)
    return ParamCounts(
        embedding=embedding,
        head=head,
        attention=attention,
        norms=norms,
        router=router,
        experts=experts,
        shared_experts=shared,
        dense_ffn=dense_ffn,
        total=total,
        active=active,
    )


def flops_per_token(m: Model, pc: ParamCounts) -> float:
    """Training FLOPs per token: 6 x active params + causal attention (6 * seq * q_dim per layer)."""
    return 6 * pc.active + 6 * m.layers * m.seq_len * m.heads * m.head_dim


class Memory(BaseModel):
    """Bytes per rank on the busiest pipeline stage."""

    params_per_rank: int  # sharded parameter count held by one rank
    parameters: int  # fp32 sharded master parameters (4 B each)
    gradients: int  # fp32 sharded gradients (4 B each)
    optimizer_state: int  # two fp32 Adam moments (8 B each); the step counters (4 B per tensor) live on the host
    model_states: int  # parameters + gradients + optimizer_state: 16 B per sharded parameter
    # pp 1: unsharded compute copies of two layers (current + prefetch) + one layer's grads; pp > 1: the
    # stage's gathered weights and, over several micro-batches, its unsharded fp32 gradients
    fsdp_buffers: int
    activations: int
    logits: int
    runtime_reserve: int
    total: int

    @property
    def total_gib(self) -> float:
        return self.total / GIB


def activation_terms(m: Model, p: Parallel, tokens: int) -> dict[str, int]:
    """Saved activation bytes for `tokens` tokens through one layer of each kind, by AC mode."""
    a = p.compute_bytes
    d, tp = m.dim, p.tp
    q_dim, kv_dim = m.heads * m.head_dim, m.kv_heads * m.head_dim
    # attention: norm input, normed input, q/k/v after RoPE, SDPA output (+ fp32 log-sum-exp)
    attn = a * tokens * (2 * d + (2 * q_dim + 2 * kv_dim) // tp) + 4 * tokens * m.heads // tp
    ffn_inputs = a * tokens * 2 * d  # norm input, normed input
    # routed experts see top_k copies of each token: input, gate, up, silu(gate)*up; fp32 router scores
    moe_ffn = (
        ffn_inputs
        + a * tokens * m.top_k * (d + 3 * m.expert_hidden)
        + a * tokens * 3 * m.shared_experts * m.expert_hidden // tp
        + 4 * tokens * m.experts
    )
    dense_ffn = ffn_inputs + a * tokens * 3 * m.dense_hidden // tp
    layer_input = a * tokens * d
    return {
        "attention": attn,
        "moe_ffn": moe_ffn,
        "dense_ffn": dense_ffn,
        "ffn_inputs": ffn_inputs,
        "layer_input": layer_input,
    }


class PipelineShape(BaseModel):
    """How a layout pipelines one step (pp 1: one stage, no bubble)."""

    pp: int
    schedule: str  # parallel.ppSchedule
    virtual_stages: int
    micro_batches: int  # per optimizer step on each data-parallel rank: global_batch / (micro_batch x dp)
    stage_layers: list[int]  # layers of each stage, in stage order; stage s runs on pp rank s % pp
    bubble: float  # idle fraction of a step on every rank: (pp-1)/(m*v + pp-1)
    # Micro-batches whose activations pp rank 0 (the busiest) holds at the peak, each through one
    # (virtual) stage: gpipe m, 1f1b min(pp, m), interleaved1f1b min(m*v, (v-1)*pp + 2*(pp-1) + 1).
    in_flight: int
    p2p_bytes_per_rank: int  # activations sent forward plus their gradients sent back, per step

    @property
    def busiest_rank_layers(self) -> int:
        """Layers held by the rank with the most (the sum over its virtual stages)."""
        return max(sum(self.stage_layers[r :: self.pp]) for r in range(self.pp))


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of a pipelined step: (pp-1) stage-times of fill and drain over m*v + pp-1 in all."""
    return (pp - 1) / (micro_batches * virtual_stages + pp - 1)


def pipeline(m: Model, p: Parallel, t: Training) -> PipelineShape:
    mbs = max(1, t.global_batch // (t.micro_batch * p.dp))
    v = p.pp_virtual_stages if p.pp > 1 else 1
    sizes = stage_layers(
        m.layers,
        p.pp * v,
        p.pp_first_stage_fewer_layers if p.pp > 1 else 0,
        p.pp_last_stage_fewer_layers if p.pp > 1 else 0,
    )
    if p.pp == 1:
        in_flight = 1
    elif p.pp_schedule == "gpipe":
        in_flight = mbs
    elif p.pp_schedule == "1f1b":
        in_flight = min(p.pp, mbs)
    else:  # torch's Interleaved1F1B: warm-up forwards of rank 0, then one more before its first backward
        in_flight = min(mbs * v, (v - 1) * p.pp + 2 * (p.pp - 1) + 1)
    a = p.compute_bytes
    # Each of the rank's v stages sends every micro-batch's output on and its input gradient back.
    p2p = 2 * mbs * v * t.micro_batch * m.seq_len * m.dim * a if p.pp > 1 else 0
    return PipelineShape(
        pp=p.pp,
        schedule=p.pp_schedule,
        virtual_stages=v,
        micro_batches=mbs,
        stage_layers=sizes,
        bubble=bubble_fraction(p.pp, mbs, v),
        in_flight=in_flight,
        p2p_bytes_per_rank=p2p,
    )


def memory(m: Model, p: Parallel, t: Training, pc: ParamCounts, pipe: PipelineShape) -> Memory:
    """Bytes per rank on the busiest stage, from the model's counts and the layout's pipeline shape."""
    compute_bytes = p.compute_bytes
    stage = pipe.busiest_rank_layers / m.layers
    outer = pc.embedding + pc.head if p.pp == 1 else max(pc.embedding, pc.head)  # first/last stage
    # As the trainer lays them out: attention and dense FFN split by tp; embedding, output head and
    # norms not tensor-parallel; the router and shared expert live in the MoE layer, FSDP-sharded
    # over dp_shard x tp (each tp rank routes its own tokens); then all of it sharded over dp_shard.
    tp_split = (pc.attention + pc.dense_ffn) * stage / p.tp
    not_split = pc.norms * stage + outer
    nonexpert_rank = (tp_split + not_split) / p.dp_shard + (pc.router + pc.shared_experts) * stage / (p.dp_shard * p.tp)
    expert_rank = pc.experts * stage / (p.dp_shard * p.tp)
    params_rank = math.ceil(nonexpert_rank + expert_rank)

    # Largest layer as one rank computes it (after tp/ep split, before FSDP sharding).
    d, hd = m.dim, m.head_dim
    attn_layer = (d * m.heads * hd * 2 + 2 * d * m.kv_heads * hd) / p.tp
    moe_layer = (m.experts // p.ep + m.shared_experts / p.tp) * 3 * d * m.expert_hidden if m.moe_layers else 0
    dense_layer = 3 * d * m.dense_hidden / p.tp if m.moe_layers < m.layers else 0
    layer = attn_layer + max(moe_layer, dense_layer)
    if p.dp_shard * p.tp == 1:  # nothing sharded: no gathered copies
        fsdp_buffers = 0
    elif p.pp == 1:  # two layers gathered (current + prefetch) and one layer's unsharded gradient
        fsdp_buffers = int(layer * (2 * compute_bytes + 4))
    else:
        # Pipelined (trainer/parallel.py _fully_shard: reshard_after_forward=False; torch's pipeline
        # stage skips the gradient sync until the last backward): the stage's weights stay gathered
        # through the schedule, and with several micro-batches its unsharded fp32 gradients too.
        unsharded = tp_split + not_split + (pc.router + pc.shared_experts) * stage + pc.experts * stage / p.ep
        fsdp_buffers = int(unsharded * compute_bytes + (unsharded if pipe.micro_batches > 1 else layer) * 4)

    tokens = t.micro_batch * m.seq_len
    act = activation_terms(m, p, tokens)
    moe_frac = m.moe_layers / m.layers
    ffn = moe_frac * act["moe_ffn"] + (1 - moe_frac) * act["dense_ffn"]
    full_layer = act["attention"] + ffn
    # Layer x micro-batch activations held at the peak: the in-flight micro-batches, each through
    # one (virtual) stage; plus one layer's recomputation at a time under activation checkpointing.
    held = pipe.in_flight * max(pipe.stage_layers)
    if p.activation_checkpointing == "none":
        activations = held * full_layer
    elif p.activation_checkpointing == "selective":  # keep attention and FFN inputs, recompute FFN internals
        activations = held * (act["attention"] + act["ffn_inputs"]) + (ffn - act["ffn_inputs"])
    else:  # full: keep each layer's input, recompute one layer at a time
        activations = held * act["layer_input"] + full_layer
    activations = int(activations)
    logits = 2 * 4 * tokens * m.vocab  # fp32 logits and their gradient (the output head is not tensor-parallel)
    model_states = params_rank * ADAM_STATE_BYTES
    total = model_states + fsdp_buffers + activations + logits + RUNTIME_RESERVE_BYTES
    return Memory(
        params_per_rank=params_rank,
        parameters=4 * params_rank,
        gradients=4 * params_rank,
        optimizer_state=8 * params_rank,
        model_states=model_states,
        fsdp_buffers=fsdp_buffers,
        activations=activations,
        logits=logits,
        runtime_reserve=RUNTIME_RESERVE_BYTES,
        total=total,
    )


class Calibration(BaseModel):
    """Efficiencies measured on one GPU type (`supernode bench gpu --calibration-out FILE` writes this
    file); the step time uses them in place of the uncalibrated defaults. A figure left None was not
    measured (e.g. EFA: `bench gpu` runs on one machine) and keeps its default."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: Literal[1] = 1
    accelerator: str  # the catalog's accelerator it was measured on (H100, B300, ...): the plan must use it
    device: str  # the CUDA device name
    measured_at: str  # ISO 8601
    matmul_efficiency: float = Field(gt=0, le=1)  # bench gpu `moe_layer_mfu`: bf16 MoE layer fwd+bwd / peak
    nvlink_efficiency: float | None = Field(default=None, gt=0, le=1)  # from `moe_layer_expert_parallel`
    efa_efficiency: float | None = Field(default=None, gt=0, le=1)
    measurements: list[dict[str, Any]] = []  # the bench lines the figures come from
    path: str | None = None  # the file the plan read it from (set by `read`)

    @property
    def nvlink(self) -> float:
        return self.nvlink_efficiency or NVLINK_EFFICIENCY

    @property
    def efa(self) -> float:
        return self.efa_efficiency or EFA_EFFICIENCY

    def describe(self) -> str:
        """One line for `supernode plan`: which figures were measured, where, and which are defaults."""
        measured = [f"compute at {self.matmul_efficiency:.0%} of peak"]
        defaults = []
        for name, value in (("NVLink", self.nvlink_efficiency), ("EFA", self.efa_efficiency)):
            (measured.append(f"{name} at {value:.0%}") if value else defaults.append(name))
        return (
            f"calibrated by {self.path or 'a calibration'} (bench gpu on {self.device}, {self.measured_at}): "
            + ", ".join(measured)
            + (f"; {' and '.join(defaults)} not measured, at catalog bandwidth" if defaults else "")
        )

    @classmethod
    def read(cls, path: str | Path, where: str = "calibration") -> Calibration:
        """A calibration file, every unusable one a BadInput naming it (`where`: the key or flag)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls.model_validate(data).model_copy(update={"path": str(path)})
        except FileNotFoundError:
            raise BadInput(f"{where} {path}: file not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadInput(f"{where} {path}: cannot be read as JSON ({e})") from None
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            raise BadInput(
                f"{where} {path}: not a calibration: {'.'.join(map(str, first['loc']))}: {first['msg']} "
                "(write one with `supernode bench gpu --calibration-out FILE`)"
            ) from None


class ChipTensorParallel(BaseModel):
    """On an accelerator with several ranks per chip (Trainium2: 4 logical NeuronCores), what the
    layout's TP collectives cost with each TP group on one chip (through the chip's HBM) against the
    same group spread over as many chips (over NeuronLink): the price of letting TP leave a chip."""

    tp: int
    ranks_per_chip: int
    inside_chip: bool  # the layout's TP groups each lie on one chip (tp divides ranks_per_chip)
    inside_chip_s: float | None  # None: tp is wider than a chip, so it cannot stay on one
    across_chips_s: float


class StepTime(BaseModel):
    """One optimizer step as the trainer runs it. step_s = compute_s + recompute_s +
    exposed_all_to_all_s + exposed_fsdp_s + tensor_parallel_s + p2p_s + pipeline_bubble_s; the other
    terms are the traffic the step moves (all_to_all_s, fsdp_s, replicate_s), of which the exposed
    ones are what the trainer does not overlap."""

    compute_s: float  # model FLOPs (6 x active params + attention) at the matmul efficiency
    recompute_s: float = 0.0  # forward FLOPs activation checkpointing runs again in backward
    all_to_all_s: float  # dispatch + combine, forward + backward
    recompute_all_to_all_s: float = 0.0  # the forward's dispatch + combine, run again by checkpointing
    exposed_all_to_all_s: float = 0.0
    fsdp_s: float  # all-gathers (per micro-batch where resharded) + the step's reduce-scatter
    replicate_s: float  # HSDP all-reduce over dp_replicate
    exposed_fsdp_s: float = 0.0  # of fsdp_s + replicate_s
    tensor_parallel_s: float  # every TP collective, recomputed ones included: none is overlapped
    step_s: float
    mfu: float
    all_to_all_bytes_per_rank: int  # per step, both directions, fwd + bwd
    # PipelineShape: the bubble (idle time: the per-micro-batch work x (pp-1)/(m*v)) and the stage-to-stage sends.
    pipeline_bubble_s: float = 0.0
    p2p_s: float = 0.0
    # The link each communication term crosses (NVLink, EFA, or NVLink+EFA for a group spanning
    # domains); terms that do not occur (degree 1) are absent.
    links: dict[str, Link] = {}
    # Accelerators with several ranks per chip only (Trainium2): TP on one chip against across chips.
    chip_tensor_parallel: ChipTensorParallel | None = None


class _Network:
    """The links one layout's collectives cross on `hw`: per-GPU rates (calibrated where measured),
    each mesh dimension's placement, and the link each costed term crossed (`links`, StepTime.links)."""

    def __init__(self, p: Parallel, hw: InstanceType, domain: int | None, cal: Calibration | None):
        self.world, self.per_node, self.link_name = p.world_size, hw.accelerators, hw.link_name
        nvlink_eff = cal.nvlink if cal else NVLINK_EFFICIENCY
        self.nvlink = hw.nvlink_gbytes_s * 1e9 / 2 * nvlink_eff  # one direction
        self.efa = hw.efa_gbytes_s * 1e9 / hw.accelerators * (cal.efa if cal else EFA_EFFICIENCY)  # per GPU
        # A domain of several instances whose link between them is slower (Trn2 UltraServer: NeuronLink
        # 256 GB/s per chip between instances, 1,024 inside one): a group that leaves its instance runs at that pace.
        self.between_nodes = (
            hw.domain_inter_node_gbytes_s * 1e9 / 2 * nvlink_eff if hw.domain_inter_node_gbytes_s else self.nvlink
        )
        self.domain = domain or hw.accelerators
        self.groups = {g.dim: g for g in place(p, self.domain)}
        self.links: dict[str, Link] = {}

    def scale_up(self, g: GroupPlacement) -> float:
        return self.nvlink if nodes_spanned(g, self.world, self.per_node) == 1 else self.between_nodes

    def ring(self, term: str, buffer_bytes: float, g: GroupPlacement) -> float:
        if g.size > 1:
            self.links[term] = scale_up_link(g.link, self.link_name)
        return ring_seconds(buffer_bytes, g, self.scale_up(g), self.efa)


def step_time(
    m: Model,
    p: Parallel,
    t: Training,
    hw: InstanceType,
    pc: ParamCounts,
    pipe: PipelineShape,
    domain: int | None = None,
    calibration: Calibration | None = None,
) -> StepTime:
    """Compute and communication time of one optimizer step on NVLink domains of `domain` GPUs
    (default: one instance), each collective costed on its mesh dimension's placement
    (`supernode.core.topology`), from the model's counts and the layout's pipeline shape; efficiencies
    from `calibration` where it measured them, else the uncalibrated defaults."""
    world = p.world_size
    flop_s = hw.peak_flops * (calibration.matmul_efficiency if calibration else MATMUL_EFFICIENCY)
    net = _Network(p, hw, domain, calibration)
    tokens_step = t.global_batch * m.seq_len
    flops_rank = tokens_step * flops_per_token(m, pc) / world
    compute = flops_rank / flop_s
    recompute = tokens_step * _recompute_per_token(m, pc, p.activation_checkpointing) / world / flop_s
    tokens_rank = tokens_step / p.dp  # tp ranks process the same tokens
    a2a_bytes, a2a, a2a_again, exposed_a2a = _all_to_all(m, p, pc, net, tokens_rank, tokens_step / world / flop_s)
    fsdp, replicate, exposed_fsdp = _fsdp(m, p, pc, pipe, net)
    # The window beside compute is shared: where the all-to-all and the FSDP/HSDP rings both cross
    # EFA (each GPU's share of the instance's EFA), the all-to-all hidden behind compute holds that
    # link, and FSDP traffic cannot hide in the same seconds.
    fsdp_links = [net.links[k] for k in ("fsdp", "fsdp_experts", "replicate") if k in net.links]
    efa_shared = "EFA" in net.links.get("all_to_all", "") and any("EFA" in link for link in fsdp_links)
    hidden_a2a = a2a + a2a_again - exposed_a2a if efa_shared else 0.0
    exposed_fsdp += max(0.0, fsdp + replicate - exposed_fsdp - max(0.0, compute + recompute - hidden_a2a))
    tpc, chip_tp = _tensor_parallel(m, p, hw, net, tokens_rank)
    p2p = _p2p(p, pipe, hw, net)
    # The bubble: (pp-1) micro-batch stage-times of fill and drain, each as long as the work a
    # micro-batch puts on the critical path (FSDP traffic is once per step, not per micro-batch).
    busy = compute + recompute + exposed_a2a + tpc + p2p
    bubble = busy * (p.pp - 1) / (pipe.micro_batches * pipe.virtual_stages)
    step = busy + exposed_fsdp + bubble
    return StepTime(
        compute_s=compute,
        recompute_s=recompute,
        all_to_all_s=a2a,
        recompute_all_to_all_s=a2a_again,
        exposed_all_to_all_s=exposed_a2a,
        fsdp_s=fsdp,
        replicate_s=replicate,
        exposed_fsdp_s=exposed_fsdp,
        tensor_parallel_s=tpc,
        step_s=step,
        mfu=flops_rank / (step * hw.peak_flops),
        all_to_all_bytes_per_rank=a2a_bytes,
        links=net.links,
        pipeline_bubble_s=bubble,
        p2p_s=p2p,
        chip_tensor_parallel=chip_tp,
    )


def _recompute_per_token(m: Model, pc: ParamCounts, ac: str) -> float:
    """FLOPs per token activation checkpointing runs again (trainer/model.py Block): "full" wraps
    Block._forward in torch.utils.checkpoint, so backward re-runs every block's forward, 1/3 of its
    6-per-parameter FLOPs (the head and loss are outside the blocks); "selective" wraps only self.ffn
    (Block._ffn), so backward re-runs the FFN/MoE forward: router, top-k routed experts, shared
    expert, dense FFN (2 FLOPs per parameter)."""
    if ac == "full":
        return (flops_per_token(m, pc) - 6 * (m.vocab * m.dim + m.dim)) / 3
    if ac == "selective":
        routed = pc.experts * m.top_k // m.experts if m.experts else 0
        return 2 * (pc.router + routed + pc.shared_experts + pc.dense_ffn)
    return 0


def _all_to_all(
    m: Model, p: Parallel, pc: ParamCounts, net: _Network, tokens_rank: float, per_flop: float
) -> tuple[int, float, float, float]:
    """The MoE dispatch and combine: (bytes per rank, seconds, seconds run again by checkpointing,
    exposed seconds)."""
    a2a_bytes = int(4 * tokens_rank * m.top_k * m.dim * p.compute_bytes * (p.ep - 1) / p.ep * m.moe_layers / p.pp)
    ep = net.groups["ep"]
    a2a = all_to_all_seconds(a2a_bytes, ep, net.scale_up(ep), net.efa)
    if p.ep > 1:
        net.links["all_to_all"] = scale_up_link(ep.link, net.link_name)
    # Both checkpointing modes re-run MoE.forward, so its dispatch and combine (the forward half of
    # the four all-to-alls) travel again (trainer/dispatcher.py AllToAllDispatcher.compute).
    forwards = 1 if p.activation_checkpointing == "none" or not m.moe_layers else 2
    again = a2a / 2 * (forwards - 1)
    exposed = a2a + again - forwards * _hidden_forward_all_to_all(m, p, pc, a2a, per_flop)
    return a2a_bytes, a2a, again, exposed


def _fsdp(m: Model, p: Parallel, pc: ParamCounts, pipe: PipelineShape, net: _Network) -> tuple[float, float, float]:
    """FSDP2's gathers and reduce-scatters and HSDP's all-reduce: (fsdp seconds, replicate seconds,
    exposed seconds before the shared-window correction of `step_time`)."""
    a = p.compute_bytes
    # FSDP2 units (trainer/parallel.py _fully_shard): each block (non-expert weights over dp_shard,
    # experts over edp) and the root (embedding, final norm, head). Per byte of buffer, a ring over each group:
    per_byte_shard = net.ring("fsdp", 1.0, net.groups["dp_shard"])
    per_byte_experts = net.ring("fsdp_experts", 1.0, net.groups["edp"])
    stage = 1 / p.pp
    nonexpert = (pc.total - pc.experts) * stage / p.tp  # gathered by each rank over dp_shard
    experts = pc.experts * stage / p.ep  # gathered over dp_shard*tp/ep
    root = (pc.embedding + pc.head + m.dim) * stage / p.tp
    block = (nonexpert - root) / (m.layers * stage)
    block_experts = experts / (m.moe_layers * stage) if m.moe_layers else 0.0

    def fsdp_pass(shard_params: float, expert_params: float, nbytes: int) -> float:
        return (shard_params * per_byte_shard + expert_params * per_byte_experts) * nbytes

    # All-gathers in the compute dtype. pp 1: blocks reshard after forward and backward, and every
    # micro-batch's gradients are reduce-scattered as its backward ends (trainer/engine.py train_step:
    # a rank holds only its gradient shard), so every micro-batch gathers each block twice, the root
    # (reshard_after_forward=False) once, and reduce-scatters everything once. pp > 1: stages keep
    # their weights gathered through the schedule (reshard_after_forward=False; pipelining's stage
    # syncs and reshards only on the last backward): once per step.
    mbs = pipe.micro_batches if p.pp == 1 else 1
    fwd_gather = fsdp_pass(nonexpert, experts, a)
    bwd_gather = fsdp_pass(nonexpert - root, experts, a) if p.pp == 1 else 0.0
    reduce = fsdp_pass(nonexpert, experts, 4)  # gradients in fp32 (reduce_dtype)
    fsdp = mbs * (fwd_gather + bwd_gather + reduce)
    shard_bytes = 4 * pc.total * stage / (p.tp * p.dp_shard)
    replicate = net.ring("replicate", 2 * shard_bytes, net.groups["dp_replicate"])  # all-reduce = RS + AG
    # Exposed: what has no compute beside it. Each forward waits for the root's and the first block's
    # gathers, each backward for its first (the last) block's; after the last backward, block 0's and
    # the root's reduce-scatter and HSDP all-reduce. The rest runs on FSDP2's own streams beside
    # compute: forward gathers prefetched one block ahead (set_modules_to_forward_prefetch, only with
    # parallel.overlap; without it every forward gather waits), backward gathers by FSDP2's default
    # backward prefetch, reduce-scatters as each block's backward ends. Traffic beyond the compute
    # it runs beside is exposed too (`step_time`).
    first = root + block, block_experts
    last_share = (root + block + block_experts) / (nonexpert + experts)
    exposed = (
        mbs * (fsdp_pass(*first, a) if p.overlap else fwd_gather)
        + (mbs * fsdp_pass(block, block_experts, a) if p.pp == 1 else 0.0)
        + fsdp_pass(*first, 4)
        + replicate * last_share
    )
    return fsdp, replicate, exposed


def _tensor_parallel(
    m: Model, p: Parallel, hw: InstanceType, net: _Network, tokens_rank: float
) -> tuple[float, ChipTensorParallel | None]:
    """TP: 2 all-reduces (RS + AG) per layer forward and backward of the activations, synchronous in
    the compute stream (DTensor's ColwiseParallel/RowwiseParallel; the MoE layer's token gather);
    checkpointing re-runs the forward ones: all of them (full), the FFN's (selective). With several
    ranks per chip, also what TP costs on one chip against across chips."""
    tp_bytes = 4 * (m.layers / p.pp) * 2 * tokens_rank * m.dim * p.compute_bytes
    recomputed_tp = {"none": 1, "selective": 1.25, "full": 1.5}[p.activation_checkpointing]
    g_tp = net.groups["tp"]
    tpc = net.ring("tensor_parallel", tp_bytes, g_tp) * recomputed_tp
    if hw.ranks_per_chip == 1:
        return tpc, None
    # The logical cores of one chip exchange through its HBM (each core's share of the chip's
    # bandwidth); a TP group wider than the chip, or spread over chips, pays NeuronLink.
    on_chip = ring_seconds(tp_bytes, g_tp, hw.hbm_gbytes_s * 1e9, net.efa) * recomputed_tp
    across = (
        tpc
        if not inside_chip(g_tp, hw.ranks_per_chip)
        else ring_seconds(tp_bytes, g_tp, net.scale_up(g_tp), net.efa) * recomputed_tp
    )
    chip_tp = ChipTensorParallel(
        tp=p.tp,
        ranks_per_chip=hw.ranks_per_chip,
        inside_chip=inside_chip(g_tp, hw.ranks_per_chip),
        inside_chip_s=on_chip if hw.ranks_per_chip % p.tp == 0 else None,
        across_chips_s=across,
    )
    if chip_tp.inside_chip:
        tpc = on_chip
        if p.tp > 1:
            net.links["tensor_parallel"] = "on-chip"
    return tpc, chip_tp


def _p2p(p: Parallel, pipe: PipelineShape, hw: InstanceType, net: _Network) -> float:
    """The pipeline's stage-to-stage sends, exposed: Schedule1F1B/GPipe fuse each send with the next
    receive and wait on both (torch.distributed.pipelining _wait_batch_p2p) before computing. Stage
    neighbours are a stage's ranks apart: EFA once a pipeline leaves the domain."""
    if p.pp == 1:
        return 0.0
    spans, _ = group_span(p.pp, p.stride("pp"), p.world_size, net.domain)
    net.links["p2p"] = hw.link_name if spans == 1 else "EFA"
    return pipe.p2p_bytes_per_rank / (net.nvlink if spans == 1 else net.efa)


def _hidden_forward_all_to_all(m: Model, p: Parallel, pc: ParamCounts, a2a: float, per_flop: float) -> float:
    """What one forward's dispatch + combine hide behind computation, as AllToAllDispatcher.compute
    (trainer/dispatcher.py) schedules them; backward's (_AllToAll.backward) are synchronous.

    Without parallel.overlap (or at ep 1) nothing. With it, K = parallel.allToAllChunks pieces, each 1/K
    of the dispatch d and of the combine c, issued asynchronously on the group's one queue:
    dispatch 0 runs beside the shared expert; while the experts compute piece i (x, 1/K of the
    routed experts' forward) the queue carries combine i-1 and dispatch i+1, and what exceeds x
    waits; combine K-1 has nothing beside it. Exposed = max(0, d - shared) + sum over the pieces of
    max(0, queued_i - x) + c, hidden = d + c (per piece, times K) less that."""
    if not p.overlap or p.ep == 1:
        return 0.0
    k = p.all_to_all_chunks
    piece = a2a / 4 / k  # each of dispatch and combine is a quarter of the four all-to-alls
    shared = 2 * pc.shared_experts * per_flop
    experts = 2 * (pc.experts * m.top_k // m.experts if m.experts else 0) * per_flop / k
    queued = [piece * ((i + 1 < k) + (i > 0)) for i in range(k)]
    exposed = max(0.0, piece - shared) + sum(max(0.0, q - experts) for q in queued) + piece
    return a2a / 2 - exposed


class CheckpointIO(BaseModel):
    checkpoint_bytes: int
    write_budget_s: int  # seconds one checkpoint write may take (storage.fsx.checkpointWriteBudgetS)
    required_mb_s: float
    fsx_capacity_gib: int  # configured, or sized by the planner
    fsx_throughput_mb_s: float
    write_seconds: float
    within_budget: bool
    sized_by_planner: bool


def fsx_capacity_for(mb_s: float, per_unit: int, min_bytes: int) -> int:
    need_tib = max(mb_s / per_unit, min_bytes / 1024**4)
    gib = math.ceil(need_tib * 1024)
    return 1200 if gib <= 1200 else math.ceil(gib / FSX_INCREMENT_GIB) * FSX_INCREMENT_GIB


def checkpoint_io(pc: ParamCounts, t: Training, fsx: FsxConfig) -> CheckpointIO:
    size = CHECKPOINT_BYTES * pc.total
    required = size / 1e6 / fsx.checkpoint_write_budget_s
    hold = size * (t.keep_checkpoints + 1)  # kept checkpoints + one being written
    capacity = fsx.capacity_gib or fsx_capacity_for(required, fsx.per_unit_throughput, hold)
    throughput = capacity / 1024 * fsx.per_unit_throughput
    seconds = size / 1e6 / throughput
    return CheckpointIO(
        checkpoint_bytes=size,
        write_budget_s=fsx.checkpoint_write_budget_s,
        required_mb_s=required,
        fsx_capacity_gib=capacity,
        fsx_throughput_mb_s=throughput,
        write_seconds=seconds,
        within_budget=seconds <= fsx.checkpoint_write_budget_s and capacity * GIB >= hold,
        sized_by_planner=fsx.capacity_gib is None,
    )


def usable_hbm_bytes(p: Parallel, hw: InstanceType) -> int:
    """HBM a rank may plan to use: the GPU's memory less the layout's headroom (`fits` means within this)."""
    return int(hw.hbm_bytes * (1 - p.hbm_headroom))


def cost_per_hour(nodes_by_type: dict[str, int], catalog: dict[str, InstanceType]) -> float:
    """What the instances cost per hour at the catalog's on-demand prices."""
    return sum(n * catalog[name].price_per_hour for name, n in nodes_by_type.items())


# Share of a GPU node's vCPUs and memory left to the kubelet, system reservations and the
# DaemonSets (device plugins, DCGM, CNI, FSx CSI node); the job's pod asks for the rest.
NODE_RESERVE_FRACTION = 0.10


class PodShape(BaseModel):
    """One distributed-job pod per GPU node, owning the whole node: requests = limits (Guaranteed)."""

    gpus: int  # accelerator devices of `device_resource`: GPUs, or Neuron devices (chips)
    efa: int
    cpu: int
    memory_gib: int
    hugepages_gib: int
    device_resource: str = "nvidia.com/gpu"  # the extended resource `gpus` counts (InstanceType.device_resource)

    @classmethod
    def for_node(cls, hw: InstanceType, hugepages_gib: int) -> PodShape:
        keep = 1 - NODE_RESERVE_FRACTION
        return cls(
            gpus=hw.chips,
            device_resource=hw.device_resource,
            efa=hw.efa_interfaces,
            cpu=int(hw.vcpus * keep),
            memory_gib=int(hw.memory_gib * keep) - hugepages_gib,
            hugepages_gib=hugepages_gib,
        )

    def times(self, n: int) -> PodShape:
        """What n such pods take together (a pool's quota)."""
        return self.model_copy(
            update={field: n * value for field, value in self.model_dump().items() if isinstance(value, int)}
        )
