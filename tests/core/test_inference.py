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


def test_prod_needs_tp4_and_says_so():
    cfg = load_stack("prod", ROOT)
    plan = build_plan("prod", cfg).inference
    assert plan.tp == 4 and plan.fits and plan.suggested_tp == 4
    at_tp1 = plan_of(cfg.model_copy(update={"inference": cfg.inference.model_copy(update={"tp": 1})}))
    assert not at_tp1.fits and at_tp1.suggested_tp == 4
    assert at_tp1.over_by_gib == pytest.approx(at_tp1.memory_per_gpu_gib - at_tp1.usable_hbm_gib)
    # the same headroom rule as training: usable = HBM x (1 - parallel.hbmHeadroom)
    assert plan.usable_hbm_gib == pytest.approx(plan.hbm_gib * (1 - cfg.parallel.hbm_headroom))


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
