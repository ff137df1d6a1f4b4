"""The one parallel-layout validator: the config, the planner's suggestions and the trainer's
start-up check all call `layout_rules`, so a layout is valid in one place or nowhere.

It checks the degrees against the model (heads, kv heads, experts, layers), the hardware (tp
inside an NVLink domain: one node, or a whole UltraServer) and the batch (global batch divisible by micro batch x
dp), and names every
problem by its config path.
"""

from __future__ import annotations

from .catalog import InstanceType
from .config.schema import NAMESPACE, Model, Parallel, Training
from .errors import Issue
from .mesh import Mesh
from .topology import place

P = f"{NAMESPACE}:"


def domain_rules(p: Mesh, hw: InstanceType, domain: int, where: str = "", prefix: str = P) -> list[Issue]:
    """The one home of the domain rule: on an accelerator that keeps EP and TP inside its scale-up
    domain (`InstanceType.keeps_ep_tp_in_domain`: Trainium's NeuronLink), every ep and tp group of
    the layout lies on one domain of `domain` ranks (`where`: what the domain is, for the message).
    The plan, its elastic layouts and its suggestions all ask this."""
    if not hw.keeps_ep_tp_in_domain:
        return []
    link, of = hw.link_name, f"{domain} {hw.rank_noun}s" + (f" ({where})" if where else "")
    return [
        Issue(
            path=f"{prefix}parallel.{g.dim}",
            value=g.size,
            message=f"{g.size} puts each {g.dim} group across {g.domains} {link} domains of {of}; the {g.dim} "
            f"group must stay inside one {link} domain: choose {prefix}parallel.{g.dim} dividing {domain} "
            "(EP/TP inside the domain, FSDP/DP across domains over EFA)",
        )
        for g in place(p, domain)
        if g.dim in ("ep", "tp") and not g.inside_domain
    ]


def layout_rules(
    m: Model, p: Parallel, t: Training, world_size: int, max_tp: int, prefix: str = P, world_source: str = ""
) -> list[Issue]:
    """model.dim is divisible by heads with an even head dim (RoPE); heads is a multiple of kvHeads;
    topK <= experts; firstDenseLayers <= layers. dpReplicate x dpShard x tp x pp equals the world
    size; tp is at most the GPUs of one NVLink domain (a node, or an UltraServer) and divides heads
    and kvHeads; ep divides experts and dpShard x tp; training.globalBatch is divisible by microBatch
    x dpReplicate x dpShard; warmupSteps is below steps. Pipeline (pp > 1): every one of the pp x
    ppVirtualStages stages holds at least one layer (`stage_layers`: an even split, less the
    first/last stage's fewer layers); ppVirtualStages > 1 only with ppSchedule interleaved1f1b, which
    needs it >= 2 (at pp 1 both are ignored); the micro-batches per step (globalBatch / (microBatch x
    dp)) are at least pp, a multiple of pp for interleaved1f1b; embeddings are tied only at pp 1 (the
    embedding and the head live on different stages)."""
    issues = _model_rules(m, prefix)
    pp_, tp_ = prefix + "parallel.", prefix + "training."
    if p.world_size != world_size:
        factors = p.factors()
        rest = p.world_size // p.dp_shard  # the other degrees' product
        # Only an integer degree is a suggestion; otherwise say what the world size must divide by.
        fix = (
            f"dpShard = {world_size // rest} would match"
            if world_size % rest == 0
            else f"no integer dpShard matches: the world size must be a multiple of the other degrees' {rest}"
        )
        issues.append(
            Issue(
                path=pp_ + "dpShard",
                value=p.dp_shard,
                message=f"{'*'.join(factors)} = {'*'.join(map(str, factors.values()))} = "
                f"{p.world_size}, but the world size is {world_size}{world_source}; {fix}",
            )
        )
    if p.tp > max_tp:
        issues.append(
            Issue(
                path=pp_ + "tp",
                value=p.tp,
                message=f"tensor parallel must stay inside an NVLink domain (<= {max_tp} GPUs)",
            )
        )
    for name, n in (("heads", m.heads), ("kvHeads", m.kv_heads)):
        if n % p.tp:
            issues.append(Issue(path=pp_ + "tp", value=p.tp, message=f"tp must divide model.{name} ({n})"))
    if m.experts % p.ep:
        issues.append(Issue(path=pp_ + "ep", value=p.ep, message=f"ep must divide model.experts ({m.experts})"))
    if (p.dp_shard * p.tp) % p.ep:
        issues.append(
            Issue(
                path=pp_ + "ep",
                value=p.ep,
                message=f"ep must divide dpShard*tp ({p.dp_shard}*{p.tp} = {p.dp_shard * p.tp})",
            )
        )
    per_step = t.micro_batch * p.dp
    if t.global_batch % per_step:
        issues.append(
            Issue(
                path=tp_ + "globalBatch",
                value=t.global_batch,
                message=f"must be divisible by microBatch*dp = {t.micro_batch}*{p.dp} = {per_step}; "
                f"e.g. {max(per_step, t.global_batch // per_step * per_step)}",
            )
        )
    else:
        issues += _pipeline_rules(m, p, t.global_batch // per_step, prefix)
    if t.warmup_steps >= t.steps and t.steps > 1:
        issues.append(Issue(path=tp_ + "warmupSteps", value=t.warmup_steps, message=f"must be below steps ({t.steps})"))
    return issues


def _model_rules(m: Model, prefix: str) -> list[Issue]:
    """The model part of `layout_rules`, which lists them."""
    issues: list[Issue] = []
    mp = prefix + "model."
    if m.dim % m.heads:
        issues.append(Issue(path=mp + "dim", value=m.dim, message=f"dim must be divisible by heads ({m.heads})"))
    elif m.head_dim % 2:
        issues.append(Issue(path=mp + "dim", value=m.dim, message="head dim (dim/heads) must be even for RoPE"))
    if m.heads % m.kv_heads:
        issues.append(
            Issue(path=mp + "kvHeads", value=m.kv_heads, message=f"heads ({m.heads}) must be a multiple of kvHeads")
        )
    if m.top_k > m.experts:
        issues.append(Issue(path=mp + "topK", value=m.top_k, message=f"topK must be at most experts ({m.experts})"))
    if m.first_dense_layers > m.layers:
        issues.append(
            Issue(path=mp + "firstDenseLayers", value=m.first_dense_layers, message=f"at most layers ({m.layers})")
        )
    return issues


def _pipeline_rules(m: Model, p: Parallel, micro_batches: int, prefix: str) -> list[Issue]:
    """The pipeline part of `layout_rules` (pp > 1), which lists them."""
    issues: list[Issue] = []
    mp, pp_, tp_ = prefix + "model.", prefix + "parallel.", prefix + "training."
    # At pp 1 the pipeline keys are ignored (a `local` layout inherits the stack's).
    if p.pp == 1:
        return issues
    interleaved = p.pp_schedule == "interleaved1f1b"
    if p.pp_virtual_stages > 1 and not interleaved:
        issues.append(
            Issue(
                path=pp_ + "ppVirtualStages",
                value=p.pp_virtual_stages,
                message=f"virtual stages need ppSchedule interleaved1f1b (got {p.pp_schedule}); use 1",
            )
        )
    if interleaved and p.pp_virtual_stages < 2:
        issues.append(
            Issue(
                path=pp_ + "ppVirtualStages",
                value=p.pp_virtual_stages,
                message="interleaved1f1b needs at least 2 virtual stages per rank (with 1 it is 1f1b)",
            )
        )
    sizes = stage_layers(m.layers, p.stages, p.pp_first_stage_fewer_layers, p.pp_last_stage_fewer_layers)
    if min(sizes) < 1:
        # Blame the fewer-layers options only when an even split alone would have worked.
        key, value = "pp", p.pp
        if m.layers >= p.stages:
            key, value = (
                ("ppFirstStageFewerLayers", p.pp_first_stage_fewer_layers)
                if sizes[0] < 1
                else ("ppLastStageFewerLayers", p.pp_last_stage_fewer_layers)
            )
        issues.append(
            Issue(
                path=pp_ + key,
                value=value,
                message=f"every pipeline stage needs a layer: model.layers {m.layers} over "
                f"pp*ppVirtualStages = {p.pp}*{p.pp_virtual_stages} stages, "
                f"{p.pp_first_stage_fewer_layers}/{p.pp_last_stage_fewer_layers} fewer on the "
                f"first/last, gives {sizes}",
            )
        )
    if micro_batches < p.pp:
        issues.append(
            Issue(
                path=tp_ + "microBatch",
                value=micro_batches,
                message=f"pp {p.pp} needs at least {p.pp} micro-batches per step to fill the pipeline, "
                f"but globalBatch/(microBatch*dp) = {micro_batches}; lower microBatch or raise "
                "globalBatch",
            )
        )
    elif interleaved and micro_batches % p.pp:
        issues.append(
            Issue(
                path=tp_ + "microBatch",
                value=micro_batches,
                message=f"interleaved1f1b needs the micro-batches per step (globalBatch/(microBatch*dp) "
                f"= {micro_batches}) to be a multiple of pp ({p.pp})",
            )
        )
    if m.tie_embeddings:
        issues.append(
            Issue(
                path=mp + "tieEmbeddings",
                value=True,
                message=f"tied embeddings need pp 1: with pp {p.pp} the embedding (first stage) and the "
                "head (last stage) live on different ranks",
            )
        )
    return issues


def stage_layers(layers: int, stages: int, first_fewer: int = 0, last_fewer: int = 0) -> list[int]:
    """Layers of each pipeline stage, in stage order (stage s runs on pp rank s % pp): the layers
    plus the first/last stage's fewer ones split evenly, the remainder to the middle stages first
    (the outer ones also embed, or run the head and the loss), then the fewer ones taken away.
    A count below 1 means the layout is invalid (`layout_rules` says so)."""
    if stages == 1:
        return [layers]
    base, extra = divmod(layers + first_fewer + last_fewer, stages)
    # Middle stages first, outer ones last: stage order 1, 2, ..., stages-2, 0, stages-1.
    order = list(range(1, stages - 1)) + [0, stages - 1]
    sizes = [base] * stages
    for s in order[:extra]:
        sizes[s] += 1
    sizes[0] -= first_fewer
    sizes[-1] -= last_fewer
    return sizes
