"""The one parallel-layout validator: the config, the planner's suggestions and the trainer's
start-up check all call `layout_rules`, so a layout is valid in one place or nowhere.

It checks the degrees against the model (heads, kv heads, experts, layers), the hardware (tp
inside an NVLink domain: one node, or a whole UltraServer) and the batch (global batch divisible by micro batch x dp), and names every
problem by its config path.
"""

from __future__ import annotations

from .config.schema import NAMESPACE, Model, Parallel, Training
from .errors import Issue

P = f"{NAMESPACE}:"


def layout_rules(m: Model, p: Parallel, t: Training, world_size: int, max_tp: int, prefix: str = P,
                 world_source: str = "") -> list[Issue]:
    """model.dim is divisible by heads with an even head dim (RoPE); heads is a multiple of kvHeads;
    topK <= experts; firstDenseLayers <= layers. dpReplicate x dpShard x tp x pp equals the world
    size; tp is at most the GPUs of one NVLink domain (a node, or an UltraServer) and divides heads and kvHeads; ep divides experts and
    dpShard x tp; pp divides layers (and pp > 1 is rejected until the trainer has a pipeline
    schedule); training.globalBatch is divisible by microBatch x dpReplicate x dpShard;
    warmupSteps is below steps."""
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
        issues.append(Issue(path=pp_ + "tp", value=p.tp, message=f"tensor parallel must stay inside an NVLink domain (<= {max_tp} GPUs)"))
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
