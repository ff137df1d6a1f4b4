"""Inference from the training plan: which served architecture our model is, and the serving plan.

Two things, both pure:

- **The mapping** (`served_architecture`, `hf_config`). Our model is exported (supernode.trainer.hf.export) as a
  Hugging Face model directory of an architecture vLLM and SGLang serve, and the mapping is exact:
  - sigmoid router + aux-loss-free bias + shared experts (+ leading dense layers): DeepSeek-V3
    style, GLM-4.5's `Glm4MoeForCausalLM` (`e_score_correction_bias`, `n_group = topk_group = 1`,
    `norm_topk_prob`, `routed_scaling_factor = 1`);
  - softmax router without shared experts: `Qwen3MoeForCausalLM` (`norm_topk_prob`; dense layers as
    `mlp_only_layers`). Qwen3 always normalises q and k per head, so this needs `model.qkNorm`, and
    it has no selection bias, so `model.biasUpdateRate` must be 0.
  Anything else is rejected with every reason at once. RoPE: ours rotates (even, odd) pairs, both
  targets rotate halves; the export permutes the rows of wq/wk (and the qk-norm weights) per head,
  which leaves q.k unchanged (the Llama conversion's trick), so the model needs no change.

- **The inference plan** (`build_inference_plan`): weights and KV cache per GPU, fit against HBM
  with training's headroom rule (`parallel.hbmHeadroom`), the smallest tensor-parallel degree that
  fits, and decode tokens/s bounded by HBM bandwidth.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from .capacity import ParamCounts
from .catalog import CATALOG, GIB, InstanceType
from .config import StackConfig
from .config.schema import Model
from .errors import BadInput

GLM4_MOE, QWEN3_MOE = "Glm4MoeForCausalLM", "Qwen3MoeForCausalLM"
RMS_NORM_EPS = 1e-6  # the model's RMSNorm (supernode.trainer.model) trains with it, the exported config declares it


class Dtype(NamedTuple):
    torch_name: str  # as torch, Hugging Face's config.json and vLLM's --dtype spell it
    bytes: int


# The weight dtypes a model is exported and served at (inference.dtype, `supernode export --dtype`).
DTYPES = {"bf16": Dtype("bfloat16", 2), "fp16": Dtype("float16", 2), "fp32": Dtype("float32", 4)}

# What a vLLM replica holds besides weights and KV cache: CUDA context, CUDA graphs, the activations
# of one prefill chunk, NCCL buffers. vLLM profiles it at start; 2 GiB per GPU is its usual order on
# H100 for models of this size (stated, not measured here: no GPU).
RUNTIME_OVERHEAD_GIB = 2.0
# Fraction of peak HBM bandwidth a decode step reaches (memory-bound GEMV/attention kernels).
HBM_EFFICIENCY = 0.7


def architecture_problems(m: Model) -> list[str]:
    """Why no served architecture represents `m` exactly ([] when one does)."""
    problems = []
    if m.dim % m.heads:
        problems.append(f"model.dim {m.dim} is not a multiple of model.heads {m.heads}")
    if m.heads % m.kv_heads:
        problems.append(f"model.heads {m.heads} is not a multiple of model.kvHeads {m.kv_heads}")
    if m.head_dim % 2:
        problems.append(f"head dim {m.head_dim} (dim / heads) is odd: RoPE rotates pairs")
    if m.router == "sigmoid":
        if m.shared_experts < 1:
            problems.append(
                f"model.router sigmoid maps to {GLM4_MOE}, which has shared experts: "
                "model.sharedExperts must be at least 1 (got 0)"
            )
        if m.moe_every != 1:
            problems.append(
                f"model.moeEvery {m.moe_every}: {GLM4_MOE} makes every layer after "
                "model.firstDenseLayers MoE; use moeEvery 1"
            )
    else:
        if m.shared_experts:
            problems.append(
                f"model.router softmax maps to {QWEN3_MOE}, which has no shared experts: "
                f"model.sharedExperts must be 0 (got {m.shared_experts}); or use router sigmoid ({GLM4_MOE})"
            )
        if not m.qk_norm:
            problems.append(
                f"model.router softmax maps to {QWEN3_MOE}, which normalises q and k per head: "
                "set model.qkNorm: true (and train with it)"
            )
        if m.bias_update_rate:
            problems.append(
                f"model.router softmax maps to {QWEN3_MOE}, which has no expert selection bias: "
                f"model.biasUpdateRate must be 0 (got {m.bias_update_rate})"
            )
    return problems


def served_architecture(m: Model) -> str:
    """The Hugging Face architecture our model is; BadInput naming every reason when there is none."""
    problems = architecture_problems(m)
    if problems:
        raise BadInput("no served architecture represents this model exactly: " + "; ".join(problems))
    return GLM4_MOE if m.router == "sigmoid" else QWEN3_MOE


def hf_config(m: Model, dtype: str = "bf16", eos: int | None = None, bos: int | None = None) -> dict:
    """config.json for the exported model (transformers 5 / vLLM field names)."""
    arch = served_architecture(m)
    common = {
        "architectures": [arch],
        "vocab_size": m.vocab,
        "hidden_size": m.dim,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.seq_len,
        "rms_norm_eps": RMS_NORM_EPS,
        "hidden_act": "silu",
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": DTYPES[dtype].torch_name,
        "dtype": DTYPES[dtype].torch_name,
        "intermediate_size": m.dense_hidden,
        "moe_intermediate_size": m.expert_hidden,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    if arch == GLM4_MOE:
        return {
            **common,
            "model_type": "glm4_moe",
            "n_routed_experts": m.experts,
            "n_shared_experts": m.shared_experts,
            "first_k_dense_replace": m.first_dense_layers,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "partial_rotary_factor": 1.0,
            "use_qk_norm": m.qk_norm,
        }
    return {
        **common,
        "model_type": "qwen3_moe",
        "num_experts": m.experts,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(m.layers) if not m.is_moe(i)],
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
        "use_sliding_window": False,
    }


# -- the inference plan -------------------------------------------------------------------------

# Prefill is compute-bound: the fraction of the dense bf16 peak a prefill chunk reaches (large GEMMs).
PREFILL_EFFICIENCY = 0.5
# The fixed cost of one collective in a decode step (launch and synchronisation), in seconds: inside a
# node's NVLink domain and across nodes over EFA. Stated orders (NCCL's small-message latency on H100
# and EFA), not measured here: no GPU. A decode step pays 2 per layer under tp (the all-reduces after
# attention and after the MLP), 2 per MoE layer under ep (the all-to-alls that dispatch tokens to their
# experts and combine them); pipeline stages hand one activation over per stage boundary.
COLLECTIVE_LATENCY_S = {"node": 15e-6, "fabric": 40e-6}
ATTENTION_TP = (1, 2, 4, 8)  # attention tensor-parallel degrees tried inside each data-parallel rank of ep


class Layout(NamedTuple):
    """One way to lay out a replica's GPUs: tp x pp (every GPU holds 1/(tp pp) of every layer) or dp x tp
    with expert parallelism (vLLM's `--enable-expert-parallel` with `--data-parallel-size`: attention
    and dense layers replicated per data-parallel rank (split tp ways inside it), each rank batching its
    own sequences, the routed experts spread over all dp x tp GPUs)."""

    kind: Literal["tp", "ep"]
    tp: int
    pp: int
    dp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def label(self) -> str:
        return f"tp {self.tp} x pp {self.pp}" if self.kind == "tp" else f"dp {self.dp} x tp {self.tp} + ep {self.gpus}"


class LayoutEstimate(BaseModel):
    """The planner's figures for one layout: what `supernode plan` prints for each candidate."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["tp", "ep"]
    tp: int
    pp: int
    dp: int
    ep: int  # experts spread over this many GPUs (1: not expert parallel)
    label: str
    memory_per_gpu_gib: float
    fits: bool
    itl_ms: float
    ttft_ms: float
    decode_tokens_s: float
    meets_targets: bool  # fits, and meets each target that is set


class InferencePlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    architecture: str
    instance_type: str
    dtype: str
    layout: Literal["tp", "ep"]  # the chosen layout (inference.layout, or the planner's choice under auto)
    tp: int  # tensor parallel: of each layer (tp layout), of attention and dense layers inside a dp rank (ep)
    pp: int
    dp: int  # data-parallel ranks of one replica (ep layout; 1 under tp)
    ep: int  # GPUs the routed experts are spread over (dp x tp under ep; 1 under tp)
    gpus_per_replica: int
    pods_per_replica: int  # > 1: the replica spans nodes (a LeaderWorkerSet)
    workload_kind: Literal["Deployment", "LeaderWorkerSet"]
    max_seq_len: int
    max_concurrency: int  # sequences one replica batches (over its dp ranks)
    max_seqs_per_engine: int  # vLLM --max-num-seqs: per data-parallel rank
    replicas_min: int
    replicas_max: int
    weights_gib: float  # the whole model at dtype
    weights_per_gpu_gib: float
    kv_per_sequence_gib: float  # at max_seq_len, all layers (the whole replica)
    kv_per_gpu_gib: float  # for max_concurrency sequences at max_seq_len
    overhead_per_gpu_gib: float
    memory_per_gpu_gib: float
    hbm_gib: float
    usable_hbm_gib: float  # HBM less parallel.hbmHeadroom, as for training
    fits: bool
    over_by_gib: float
    suggested_tp: int | None  # the smallest tp (at this pp) that fits; None if none within a node
    hbm_gbytes_s: float
    decode_step_s: float  # one decode step at max_concurrency, full context
    decode_tokens_s: float  # per replica, at max_concurrency
    decode_tokens_s_single: float  # one sequence alone
    itl_ms: float  # inter-token latency at max_concurrency (= decode_step_s)
    itl_target_ms: float | None
    meets_itl_target: bool | None
    ttft_ms: float  # time to first token of one max_seq_len prompt (its prefill), the replica otherwise idle
    ttft_target_ms: float | None
    meets_ttft_target: bool | None
    alternatives: tuple[LayoutEstimate, ...]  # every layout the planner weighed, the chosen one included


def kv_bytes_per_token(m: Model, dtype: str, tp: int = 1, pp: int = 1) -> float:
    """K and V of one token on one GPU: layers / pp, kv heads / tp (a kv head is replicated, not split,
    when tp exceeds the kv heads)."""
    return 2 * math.ceil(m.layers / pp) * math.ceil(m.kv_heads / tp) * m.head_dim * DTYPES[dtype].bytes


def weight_bytes(params: ParamCounts, dtype: str) -> int:
    return params.total * DTYPES[dtype].bytes


def _touched(m: Model, batch: int) -> float:
    """Expected experts of a MoE layer some of `batch` tokens pick: E * (1 - (1 - k/E)^batch)."""
    return m.experts * (1 - (1 - m.top_k / m.experts) ** batch) if m.experts else 0.0


def _decode_read_bytes(m: Model, p: ParamCounts, dtype: str, batch: int, context: int, tp: int, pp: int) -> float:
    """Bytes one GPU reads from HBM in one decode step of `batch` sequences under tp x pp: the weights its
    stages use (of each MoE layer only the experts some token picks) and the batch's KV cache at `context`."""
    expert_bytes = p.experts * (_touched(m, batch) / m.experts if m.experts else 0)
    weights = (p.total - p.experts + expert_bytes) * DTYPES[dtype].bytes / (tp * pp)
    return weights + batch * context * kv_bytes_per_token(m, dtype, tp, pp)


def _per_engine(conc: int, lay: Layout) -> int:
    return -(-conc // lay.dp)


def _memory_of(m: Model, p: ParamCounts, dtype: str, lay: Layout, seq: int, conc: int) -> tuple[float, float, float]:
    """Weights, KV cache and their total with the runtime, per GPU (bytes)."""
    b = DTYPES[dtype].bytes
    if lay.kind == "tp":
        w = p.total * b / (lay.tp * lay.pp)
    else:  # the routed experts over every GPU, the rest split tp ways inside a dp rank
        w = (p.total - p.experts) * b / lay.tp + p.experts * b / lay.gpus
    kv = _per_engine(conc, lay) * seq * kv_bytes_per_token(m, dtype, lay.tp, lay.pp)
    return w, kv, w + kv + RUNTIME_OVERHEAD_GIB * GIB


def _memory(
    m: Model, params: ParamCounts, dtype: str, tp: int, pp: int, seq: int, conc: int
) -> tuple[float, float, float]:
    return _memory_of(m, params, dtype, Layout("tp", tp, pp, 1), seq, conc)


def _collective_s(lay: Layout, hw: InstanceType) -> float:
    """The fixed cost of one collective of this layout: over the fabric once its group spans nodes."""
    group = lay.tp if lay.kind == "tp" else lay.gpus
    return COLLECTIVE_LATENCY_S["fabric" if group > hw.accelerators else "node"]


def _decode_step_s(m: Model, p: ParamCounts, dtype: str, lay: Layout, batch: int, ctx: int, hw: InstanceType) -> float:
    """One decode step of `batch` sequences of the replica: HBM reads at HBM_EFFICIENCY plus the
    collectives' fixed costs and bytes."""
    bw = hw.hbm_gbytes_s * 1e9 * HBM_EFFICIENCY
    b = DTYPES[dtype].bytes
    link = (hw.nvlink_gbytes_s if lay.gpus <= hw.accelerators else hw.efa_interfaces * hw.efa_gbps / 8) * 1e9
    if lay.kind == "tp":
        # pp stages run one after another for one token: pp stages' reads in series
        read_s = lay.pp * _decode_read_bytes(m, p, dtype, batch, ctx, lay.tp, lay.pp) / bw
        reduces = 2 * m.layers if lay.tp > 1 else 0
        reduce_bytes = 2 * (lay.tp - 1) / lay.tp * batch * m.dim * b  # ring all-reduce, per collective
        comm_s = reduces * (_collective_s(lay, hw) + reduce_bytes / link) + (lay.pp - 1) * _collective_s(lay, hw)
        return read_s + comm_s
    per_rank = _per_engine(batch, lay)
    expert_bytes = p.experts * (_touched(m, batch) / m.experts if m.experts else 0) / lay.gpus
    dense_bytes = (p.total - p.experts) / lay.tp
    read = (dense_bytes + expert_bytes) * b + per_rank * ctx * kv_bytes_per_token(m, dtype, lay.tp, 1)
    # dispatch and combine: each of a rank's tokens to its top-k experts' GPUs and back
    a2a_bytes = per_rank * m.top_k * m.dim * b / lay.tp
    comm_s = 2 * m.moe_layers * (_collective_s(lay, hw) + a2a_bytes / link)
    if lay.tp > 1:  # attention's all-reduces inside each dp rank
        comm_s += 2 * m.layers * COLLECTIVE_LATENCY_S["node"]
    return read / bw + comm_s


def _ttft_s(m: Model, p: ParamCounts, lay: Layout, seq: int, hw: InstanceType) -> float:
    """Prefill of one `seq`-token prompt on an idle replica: 2 flops per active parameter per token,
    and causal attention's 2 x seq^2 x dim per layer, at PREFILL_EFFICIENCY of the dense peak. Under tp the
    whole replica computes it (pp stages in series: tp GPUs at a time); under ep one dp rank's attention
    and dense layers (tp GPUs) and the experts spread over all GPUs."""
    peak = hw.bf16_tflops * 1e12 * PREFILL_EFFICIENCY
    expert_active = p.experts * (m.top_k / m.experts) if m.experts else 0
    dense_flops = 2 * (p.active - expert_active) * seq + 2 * m.layers * seq * seq * m.dim
    expert_flops = 2 * expert_active * seq
    if lay.kind == "tp":
        return (dense_flops + expert_flops) / (lay.tp * peak)
    return dense_flops / (lay.tp * peak) + expert_flops / (lay.gpus * peak)


def _layouts(m: Model, gpus: int, tp: int, pp: int, hw: InstanceType, choice: str) -> list[Layout]:
    """The layouts of `gpus` GPUs the planner weighs: the stack's tp x pp, and (with experts, and more
    than one GPU) dp x tp with expert parallelism, tp inside a node and dividing the heads."""
    out = [Layout("tp", tp, pp, 1)] if choice in ("auto", "tp") else []
    if choice in ("auto", "ep") and m.experts and gpus > 1:
        out += [
            Layout("ep", t, 1, gpus // t)
            for t in ATTENTION_TP
            if t <= hw.accelerators and gpus % t == 0 and m.heads % t == 0 and m.experts % gpus == 0 and gpus // t > 1
        ]
    return out or [Layout("tp", tp, pp, 1)]


def _estimate(
    m: Model, p: ParamCounts, dtype: str, lay: Layout, seq: int, conc: int, usable: float, hw: InstanceType, inf
) -> LayoutEstimate:
    total = _memory_of(m, p, dtype, lay, seq, conc)[2]
    step = _decode_step_s(m, p, dtype, lay, conc, seq, hw)
    ttft = _ttft_s(m, p, lay, seq, hw)
    fits = total <= usable
    meets = (
        fits
        and (inf.itl_target_ms is None or step * 1e3 <= inf.itl_target_ms)
        and (inf.ttft_target_ms is None or ttft * 1e3 <= inf.ttft_target_ms)
    )
    return LayoutEstimate(
        kind=lay.kind,
        tp=lay.tp,
        pp=lay.pp,
        dp=lay.dp,
        ep=lay.gpus if lay.kind == "ep" else 1,
        label=lay.label,
        memory_per_gpu_gib=total / GIB,
        fits=fits,
        itl_ms=step * 1e3,
        ttft_ms=ttft * 1e3,
        decode_tokens_s=conc / step,
        meets_targets=meets,
    )


def _rank(e: LayoutEstimate) -> tuple:
    """Which layout the planner prefers: one that fits and meets its targets, then one that fits, then
    the lower inter-token latency (the decode throughput of a replica at max_concurrency), then tp
    (fewer processes to coordinate)."""
    return (not e.meets_targets, not e.fits, round(e.itl_ms, 6), e.kind != "tp")


def build_inference_plan(cfg: StackConfig, params: ParamCounts, hw: InstanceType | None = None) -> InferencePlan | None:
    """The serving plan of the stack's `inference` section (None without one); `params`: the model's
    counts, as the training estimate made them (one count per plan).

    A replica has tp x pp GPUs (the stack's `inference.tp` and `inference.pp`). Under `inference.layout:
    auto` the planner lays them out either as tp x pp or as dp x tp with expert parallelism (the MoE's
    experts spread over every GPU, attention replicated per data-parallel rank), whichever fits and meets
    the ITL/TTFT targets with the lower ITL by its estimate (`_rank`); `tp` or `ep` forces one."""
    inf = cfg.inference
    if inf is None:
        return None
    m = cfg.model
    hw = hw or min((CATALOG[g.instance_type] for g in cfg.accelerator_node_groups), key=lambda t: t.hbm_mib)
    arch = served_architecture(m)
    if hw.vendor_row.not_served_because:
        raise BadInput(
            f"inference: serving on {hw.accelerator} ({hw.name}) is not supported: "
            f"{hw.vendor_row.not_served_because}; remove supernode:inference from this stack and serve the "
            "export (supernode export) from a GPU stack"
        )
    usable = hw.hbm_bytes * (1 - cfg.parallel.hbm_headroom)
    seq, conc = inf.max_seq_len, inf.max_concurrency
    gpus = inf.tp * inf.pp
    layouts = _layouts(m, gpus, inf.tp, inf.pp, hw, inf.layout)
    estimates = [_estimate(m, params, inf.dtype, lay, seq, conc, usable, hw, inf) for lay in layouts]
    best = min(range(len(layouts)), key=lambda i: _rank(estimates[i]))
    lay, est = layouts[best], estimates[best]
    w, kv, total = _memory_of(m, params, inf.dtype, lay, seq, conc)
    suggested = next(
        (
            t
            for t in (1, 2, 4, 8, 16, 32, 64)
            if t <= hw.accelerators
            and m.heads % t == 0
            and _memory(m, params, inf.dtype, t, inf.pp, seq, conc)[2] <= usable
        ),
        None,
    )
    step_s = est.itl_ms / 1e3
    single_s = _decode_step_s(m, params, inf.dtype, lay, 1, seq, hw)
    return InferencePlan(
        architecture=arch,
        instance_type=hw.name,
        dtype=inf.dtype,
        layout=lay.kind,
        tp=lay.tp,
        pp=lay.pp,
        dp=lay.dp,
        ep=est.ep,
        gpus_per_replica=gpus,
        pods_per_replica=-(-gpus // hw.accelerators),
        workload_kind="Deployment" if gpus <= hw.accelerators else "LeaderWorkerSet",
        max_seq_len=seq,
        max_concurrency=conc,
        max_seqs_per_engine=_per_engine(conc, lay),
        replicas_min=inf.replicas_min,
        replicas_max=inf.replicas_max,
        weights_gib=weight_bytes(params, inf.dtype) / GIB,
        weights_per_gpu_gib=w / GIB,
        kv_per_sequence_gib=seq * kv_bytes_per_token(m, inf.dtype) / GIB,
        kv_per_gpu_gib=kv / GIB,
        overhead_per_gpu_gib=RUNTIME_OVERHEAD_GIB,
        memory_per_gpu_gib=total / GIB,
        hbm_gib=hw.hbm_gib,
        usable_hbm_gib=usable / GIB,
        fits=total <= usable,
        over_by_gib=max(0.0, (total - usable) / GIB),
        suggested_tp=suggested,
        hbm_gbytes_s=hw.hbm_gbytes_s,
        decode_step_s=step_s,
        decode_tokens_s=conc / step_s,
        decode_tokens_s_single=1 / single_s,
        itl_ms=est.itl_ms,
        itl_target_ms=inf.itl_target_ms,
        meets_itl_target=None if inf.itl_target_ms is None else est.itl_ms <= inf.itl_target_ms,
        ttft_ms=est.ttft_ms,
        ttft_target_ms=inf.ttft_target_ms,
        meets_ttft_target=None if inf.ttft_target_ms is None else est.ttft_ms <= inf.ttft_target_ms,
        alternatives=tuple(estimates),
    )
