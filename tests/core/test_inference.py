"""The inference planner against a hand computation, and the architecture mapping's rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from supernode.core.capacity import param_counts
from supernode.core.catalog import CATALOG, GIB
from supernode.core.config import Model, load_stack
from supernode.core.config.schema import Inference
from supernode.core.errors import BadInput
from supernode.core.inference import (
    GLM4_MOE,
    HBM_EFFICIENCY,
    QWEN3_MOE,
    RUNTIME_OVERHEAD_GIB,
    build_inference_plan,
    hf_config,
    served_architecture,
)
from supernode.core.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "docker.io/vllm/vllm-openai@sha256:" + "a" * 64
SMALL = Model(
    layers=2,
    dim=64,
    heads=4,
    kv_heads=2,
    experts=4,
    top_k=2,
    shared_experts=1,
    expert_hidden=32,
    dense_hidden=128,
    first_dense_layers=1,
    vocab=100,
    seq_len=128,
    router="sigmoid",
)


def plan_of(cfg):
    """The inference plan from the model's counts, as build_plan hands them over."""
    return build_inference_plan(cfg, param_counts(cfg.model))


def _cfg(model: Model, **inference):
    cfg = load_stack("dev", ROOT)
    return cfg.model_copy(update={"model": model, "inference": Inference(image=IMAGE, **inference)})


def test_small_model_by_hand():
    plan = plan_of(_cfg(SMALL, max_seq_len=128, max_concurrency=4))
    # parameters: embedding 6400 + head 6400 + attention 2 x (64*64 + 2*64*32 + 64*64) = 24576
    # + norms 320 + router 256 + experts 4*3*64*32 = 24576 + shared 3*64*32 = 6144 + dense 3*64*128 = 24576
    total = 6400 + 6400 + 24576 + 320 + 256 + 24576 + 6144 + 24576
    assert total == 93248
    assert plan.weights_gib * GIB == pytest.approx(2 * total)
    # KV: K and V x 2 layers x 2 kv heads x head dim 16 x 2 bytes = 256 bytes per token
    assert plan.kv_per_sequence_gib * GIB == pytest.approx(128 * 256)
    assert plan.kv_per_gpu_gib * GIB == pytest.approx(4 * 128 * 256)
    assert plan.memory_per_gpu_gib == pytest.approx((2 * total + 4 * 128 * 256) / GIB + RUNTIME_OVERHEAD_GIB)
    assert plan.fits and plan.suggested_tp == 1 and plan.workload_kind == "Deployment"
    # decode at 4 sequences: of each MoE layer's 4 experts, 4 * (1 - (1 - 2/4)^4) = 3.75 are read
    read = (total - 24576 + 24576 * 3.75 / 4) * 2 + 4 * 128 * 256
    step = read / (CATALOG["p5.48xlarge"].hbm_gbytes_s * 1e9 * HBM_EFFICIENCY)
    assert plan.decode_step_s == pytest.approx(step)
    assert plan.decode_tokens_s == pytest.approx(4 / step)
    assert plan.itl_ms == pytest.approx(step * 1e3)


def _inference(cfg, **change):
    return cfg.model_copy(update={"inference": cfg.inference.model_copy(update=change)})


def test_prod_needs_tp4_and_says_so():
    # prod's model at 64 sequences of 8k, one replica per node, tensor parallel only
    cfg = _inference(load_stack("prod", ROOT), tp=4, pp=1, max_concurrency=64, layout="tp")
    plan = plan_of(cfg)
    assert plan.tp == 4 and plan.fits and plan.suggested_tp == 4
    at_tp1 = plan_of(_inference(cfg, tp=1))
    assert not at_tp1.fits and at_tp1.suggested_tp == 4
    assert at_tp1.over_by_gib == pytest.approx(at_tp1.memory_per_gpu_gib - at_tp1.usable_hbm_gib)
    # the same headroom rule as training: usable = HBM x (1 - parallel.hbmHeadroom)
    assert plan.usable_hbm_gib == pytest.approx(plan.hbm_gib * (1 - cfg.parallel.hbm_headroom))


def test_prod_serves_a_replica_wider_than_a_node_with_expert_parallel(capsys):
    """The shipped prod stack: 512 sequences of 8k need 16 GPUs a replica (two p5 nodes); of the layouts
    of 16 the planner weighs, tp 8 x pp 2 reads every stage in series per token, dp 2 x tp 8 + ep 16 keeps
    attention inside a node and spreads the experts: the lower ITL, and both meet the targets."""
    plan = build_plan("prod", load_stack("prod", ROOT)).inference
    for e in plan.alternatives:
        print(f"prod {e.label}: {e.memory_per_gpu_gib:.1f} GiB/GPU, ITL {e.itl_ms:.2f} ms, TTFT {e.ttft_ms:.1f} ms")
    assert (plan.layout, plan.dp, plan.tp, plan.pp, plan.ep) == ("ep", 2, 8, 1, 16)
    assert plan.gpus_per_replica == 16 and plan.pods_per_replica == 2 and plan.workload_kind == "LeaderWorkerSet"
    assert plan.fits and plan.meets_itl_target and plan.meets_ttft_target
    assert plan.max_seqs_per_engine == 256  # vLLM's --max-num-seqs is per data-parallel engine
    tp = next(e for e in plan.alternatives if e.kind == "tp")
    assert (tp.tp, tp.pp) == (8, 2) and tp.itl_ms > plan.itl_ms
    assert all(e.itl_ms >= plan.itl_ms for e in plan.alternatives if e.meets_targets)


def test_ep_beats_tp_by_the_planners_estimate_where_tp_replicates_the_kv_cache(capsys):
    """prod's model with 4 kv heads on one node of 8: under tp 8 each kv head is held by 2 GPUs (the KV
    cache replicated twice), under dp 2 x tp 4 + ep 8 it is not, and the experts are spread over all 8."""
    base = load_stack("prod", ROOT)
    cfg = _inference(
        base.model_copy(update={"model": base.model.model_copy(update={"kv_heads": 4})}),
        tp=8,
        pp=1,
        max_concurrency=128,
    )
    plan = plan_of(cfg)
    by = {e.label: e for e in plan.alternatives}
    tp, ep = by["tp 8 x pp 1"], by["dp 2 x tp 4 + ep 8"]
    print(
        f"tp 8: ITL {tp.itl_ms:.2f} ms, {tp.memory_per_gpu_gib:.1f} GiB/GPU; "
        f"dp 2 x tp 4 + ep 8: ITL {ep.itl_ms:.2f} ms, {ep.memory_per_gpu_gib:.1f} GiB/GPU"
    )
    assert ep.itl_ms < tp.itl_ms and ep.memory_per_gpu_gib < tp.memory_per_gpu_gib
    assert (plan.layout, plan.dp, plan.tp, plan.ep) == ("ep", 2, 4, 8)
    assert plan.workload_kind == "Deployment"  # 8 GPUs: one node
    # forced: the stack's layout is obeyed even where the other is estimated better
    forced = plan_of(_inference(cfg, layout="tp"))
    assert (forced.layout, forced.tp, forced.dp, forced.ep) == ("tp", 8, 1, 1)
    assert forced.itl_ms == pytest.approx(tp.itl_ms)


def test_ep_memory_by_hand():
    """dp x tp + ep: every GPU holds the non-expert weights / tp and the routed experts / (dp tp), and the
    KV cache of its own engine's sequences (max_concurrency / dp)."""
    p = param_counts(SMALL)
    plan = plan_of(_cfg(SMALL, tp=2, pp=1, layout="ep", max_seq_len=128, max_concurrency=4))
    assert (plan.layout, plan.dp, plan.tp, plan.ep) == ("ep", 2, 1, 2)
    assert plan.weights_per_gpu_gib * GIB == pytest.approx(2 * (p.total - p.experts) + 2 * p.experts / 2)
    assert plan.kv_per_gpu_gib * GIB == pytest.approx(2 * 128 * 256)  # 2 of the 4 sequences, 256 B a token
    assert plan.max_seqs_per_engine == 2


def test_a_layout_that_misses_its_target_is_marked():
    plan = plan_of(_cfg(SMALL, tp=2, itl_target_ms=1e-6, ttft_target_ms=1e-6))
    assert plan.meets_itl_target is False and plan.meets_ttft_target is False
    assert not any(e.meets_targets for e in plan.alternatives)


def test_replica_across_nodes_is_a_leaderworkerset():
    plan = plan_of(_cfg(SMALL, tp=4, pp=4))
    assert plan.gpus_per_replica == 16 and plan.pods_per_replica == 2 and plan.workload_kind == "LeaderWorkerSet"


def test_bandwidth_scales_decode():
    base = _cfg(SMALL)
    h200 = base.model_copy(
        update={
            "accelerator_node_groups": [
                base.accelerator_node_groups[0].model_copy(update={"instance_type": "p5e.48xlarge"})
            ]
        }
    )
    a, b = plan_of(base), plan_of(h200)
    assert b.decode_tokens_s / a.decode_tokens_s == pytest.approx(4800 / 3350)


def test_mapping():
    assert served_architecture(SMALL) == GLM4_MOE
    q = SMALL.model_copy(update={"router": "softmax", "shared_experts": 0, "qk_norm": True, "bias_update_rate": 0.0})
    assert served_architecture(q) == QWEN3_MOE
    c = hf_config(q.model_copy(update={"moe_every": 2, "first_dense_layers": 0, "layers": 4}))
    assert c["mlp_only_layers"] == [1, 3] and c["num_experts"] == 4 and "n_shared_experts" not in c
    g = hf_config(SMALL)
    assert (g["first_k_dense_replace"], g["n_group"], g["routed_scaling_factor"], g["head_dim"]) == (1, 1, 1.0, 16)
    with pytest.raises(BadInput, match="sharedExperts must be 0.*qkNorm.*biasUpdateRate"):
        served_architecture(SMALL.model_copy(update={"router": "softmax"}))


def test_inference_config_rules():
    with pytest.raises(ValueError, match="pinned by digest"):
        Inference(image="vllm/vllm-openai:latest")
    with pytest.raises(ValueError, match="replicasMax must be at least replicasMin"):
        Inference(image=IMAGE, replicas_min=3, replicas_max=2)
