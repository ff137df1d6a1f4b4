"""Planner figures against values computed by hand for a tiny model (see the arithmetic inline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supernode.core import capacity as cap
from supernode.core.catalog import CATALOG, GIB
from supernode.core.config import FsxConfig, Model, Parallel, Training, from_mapping, load_stack
from supernode.core.layout import layout_rules
from supernode.core.plan import Plan, build_local_plan, build_plan
from supernode.core.search import fitting_layouts, suggest

ROOT = Path(__file__).resolve().parents[2]

# 2 layers (layer 0 dense, layer 1 MoE), d=64, 4 heads of 16, 2 kv heads, 4 experts top-2, 1 shared.
TINY = Model(
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
    seq_len=16,
)
FP32_EP2 = Parallel(dp_shard=2, ep=2, mixed_precision="fp32")
TRAIN = Training(global_batch=4, micro_batch=2, steps=10, lr=1e-3, checkpoint_interval=5)


def memory(m: Model, p: Parallel, t: Training) -> cap.Memory:
    """The estimate's memory step, handed the counts and the pipeline shape as a plan build hands them."""
    return cap.memory(m, p, t, cap.param_counts(m), cap.pipeline(m, p, t))


def step_time(m: Model, p: Parallel, t: Training, hw, domain: int | None = None) -> cap.StepTime:
    return cap.step_time(m, p, t, hw, cap.param_counts(m), cap.pipeline(m, p, t), domain)


def test_parameter_counts_by_hand():
    pc = cap.param_counts(TINY)
    assert pc.embedding == 100 * 64 == 6400
    assert pc.head == 6400
    assert pc.attention == 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64) == 24576
    assert pc.norms == 2 * 2 * 64 + 64 == 320
    assert pc.router == 64 * 4 == 256
    assert pc.experts == 4 * 3 * 64 * 32 == 24576
    assert pc.shared_experts == 3 * 64 * 32 == 6144
    assert pc.dense_ffn == 3 * 64 * 128 == 24576
    assert pc.total == 93248
    # active: no embedding lookup, only top-2 of 4 experts (2 unused x 6144)
    assert pc.active == 93248 - 6400 - 2 * 6144 == 74560


def test_flops_per_token_by_hand():
    # 6 x active + 6 x layers x seq x q_dim (causal attention, fwd + bwd)
    assert cap.flops_per_token(TINY, cap.param_counts(TINY)) == 6 * 74560 + 6 * 2 * 16 * 64 == 459648


def test_memory_terms_by_hand():
    mem = memory(TINY, FP32_EP2, TRAIN)
    # non-expert: (attn 24576 + shared 6144 + dense 24576 + emb 6400 + head 6400) / tp 1 + norms/router 576,
    # FSDP over dp_shard 2 -> 34336; experts 24576 / (dp_shard 2 * tp 1) -> 12288
    assert mem.params_per_rank == 34336 + 12288 == 46624
    assert mem.model_states == 46624 * 16
    # largest layer unsharded: attention 12288 + dense FFN 24576 (> MoE: (4/2 + 1) * 6144 = 18432),
    # fp32: two gathered copies (2 x 4 B) + one fp32 gradient (4 B)
    assert mem.fsdp_buffers == (12288 + 24576) * 12 == 442368
    # activations for 32 tokens, 4 B: attention 4*32*(128 + 192) + 4*32*4 = 41472;
    # MoE FFN 16384 + 4*32*2*(64+96) + 4*32*3*32 + 4*32*4 = 70144; dense FFN 16384 + 4*32*384 = 65536
    # two layers, half of them MoE: 2 * (41472 + (70144 + 65536) / 2)
    assert mem.activations == 2 * (41472 + 67840) == 218624
    assert mem.logits == 2 * 4 * 32 * 100 == 25600
    assert mem.total == 745984 + 442368 + 218624 + 25600 + cap.RUNTIME_RESERVE_BYTES


def test_activation_checkpointing_modes_by_hand():
    full = memory(TINY, FP32_EP2.model_copy(update={"activation_checkpointing": "full"}), TRAIN)
    # each layer keeps its input (4*32*64 = 8192) + one layer is recomputed at a time (109312)
    assert full.activations == 2 * 8192 + 109312
    sel = memory(TINY, FP32_EP2.model_copy(update={"activation_checkpointing": "selective"}), TRAIN)
    # attention + FFN inputs kept per layer; one FFN's internals (67840 - 16384) recomputed
    assert sel.activations == 2 * (41472 + 16384) + (67840 - 16384)
    none = memory(TINY, FP32_EP2, TRAIN)
    assert full.activations < sel.activations < none.activations


def test_a_local_plan_is_costed_in_the_dtype_the_cpu_computes_in():
    """Issue 35: the compute dtype had two owners; a `local` section that inherits mixedPrecision bf16
    was planned in bf16 while the trainer ran it in fp32 on CPU. One rule (`Parallel.computed_on`) now
    decides both: a plan is costed for its device (`Plan.device`, the one the trainer runs it on), so
    the local plan says fp32 and costs 4-byte activations; a cluster plan keeps bf16."""
    data = load_stack("dev", ROOT).to_mapping()
    data["local"]["parallel"].pop("mixedPrecision")
    cfg = from_mapping(data)
    assert cfg.parallel.mixed_precision == "bf16" and cfg.local_config().parallel.mixed_precision == "bf16"
    local = build_local_plan("dev", cfg)
    assert local.parallel.mixed_precision == "fp32"
    assert local.parallel == cfg.local_config().parallel.model_copy(update={"mixed_precision": "fp32"})
    explicit = build_local_plan("dev", load_stack("dev", ROOT))  # the shipped local section says fp32
    assert local.memory == explicit.memory and local.step == explicit.step
    assert build_plan("dev", cfg).parallel.mixed_precision == "bf16"
    assert build_local_plan("dev", cfg, device="cuda").parallel.mixed_precision == "bf16"  # bench gpu's plan
    p = cfg.parallel
    assert (p.compute_bytes, p.computed_on("cpu").compute_bytes, p.computed_on("cuda") is p) == (2, 4, True)


def test_bf16_halves_activations_and_tp_splits_weights():
    bf16 = memory(TINY, FP32_EP2.model_copy(update={"mixed_precision": "bf16"}), TRAIN)
    fp32 = memory(TINY, FP32_EP2, TRAIN)
    assert bf16.model_states == fp32.model_states  # fp32 master/grads/moments either way
    assert bf16.activations < fp32.activations
    tp2 = memory(TINY, Parallel(dp_shard=1, tp=2, ep=2, mixed_precision="fp32"), TRAIN)
    # As the trainer lays it out: (attention 24576 + dense 24576) / tp 2; norms 320 + embedding 6400 + head
    # 6400 not tensor-parallel; (router 256 + shared 6144) / (dp_shard 1 x tp 2); experts 24576 / (1 x 2)
    assert tp2.params_per_rank == 49152 // 2 + 13120 + 6400 // 2 + 12288
    assert tp2.logits == memory(TINY, FP32_EP2, TRAIN).logits  # the output head is not split by tp


def test_checkpoint_size_and_fsx_sizing():
    ck = cap.checkpoint_io(cap.param_counts(TINY), TRAIN, FsxConfig(checkpoint_write_budget_s=60))
    assert ck.checkpoint_bytes == 12 * 93248
    assert ck.fsx_capacity_gib == 1200 and ck.within_budget
    # 10 TB checkpoint in 300 s needs 33,333 MB/s: at 500 MB/s/TiB that is 66.7 TiB -> 69,600 GiB (x 2400)
    assert cap.fsx_capacity_for(10e12 / 1e6 / 300, 500, 0) == 69600
    small = cap.checkpoint_io(
        cap.param_counts(TINY),
        TRAIN,
        FsxConfig(capacity_gib=1200, per_unit_throughput=125, checkpoint_write_budget_s=10),
    )
    assert small.fsx_throughput_mb_s == pytest.approx(1200 / 1024 * 125)


def test_all_to_all_volume_by_hand():
    hw = CATALOG["p5.48xlarge"]
    st = step_time(TINY, Parallel(dp_shard=2, ep=2, mixed_precision="fp32"), TRAIN, hw)
    # tokens per rank 4*16/2 = 32; 4 passes (dispatch+combine, fwd+bwd) x 32 x top-2 x 64 x 4 B x 1/2 x 1 MoE layer
    assert st.all_to_all_bytes_per_rank == 4 * 32 * 2 * 64 * 4 // 2
    assert 0 < st.mfu <= cap.MATMUL_EFFICIENCY


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_stacks_fit(stack):
    plan = build_plan(stack, load_stack(stack, ROOT))
    assert plan.fits and plan.memory_per_rank_gib < plan.hbm_gib
    assert plan.world_size == plan.degrees.dp_replicate * plan.degrees.dp_shard * plan.degrees.tp * plan.degrees.pp


def test_prod_is_a_50_to_200b_moe_on_128_h100():
    plan = build_plan("prod", load_stack("prod", ROOT))
    assert 50e9 <= plan.params.total <= 200e9
    assert plan.world_size >= 128 and plan.hardware.accelerator == "H100"


def test_plan_that_does_not_fit_says_by_how_much_and_suggests_layouts():
    cfg = load_stack("prod", ROOT)
    cfg = cfg.model_copy(
        update={
            "parallel": cfg.parallel.model_copy(
                update={"dp_replicate": 16, "dp_shard": 8, "ep": 8, "activation_checkpointing": "none"}
            ),
            "training": cfg.training.model_copy(update={"micro_batch": 4, "global_batch": 1024}),
        }
    )
    plan = build_plan("prod", cfg)
    assert not plan.fits and plan.over_by_gib > 0
    # "fits" means within the usable HBM (HBM less the layout's headroom), the figure the policy reads.
    assert plan.usable_hbm_gib == pytest.approx(plan.hbm_gib * (1 - cfg.parallel.hbm_headroom))
    assert plan.over_by_gib == pytest.approx(plan.memory_per_rank_gib - plan.usable_hbm_gib)
    assert plan.suggestions
    for s in plan.suggestions:
        assert s.dp_replicate * s.dp_shard * s.tp * s.pp == plan.world_size and s.memory_gib <= plan.usable_hbm_gib


def test_plan_json_round_trip():
    plan = build_plan("dev", load_stack("dev", ROOT))
    assert Plan.from_json(plan.to_json()) == plan
    summary = plan.summary()
    assert {"world_size", "degrees", "memory_per_rank_gib", "hbm_gib", "fits"} <= summary.keys()


def test_local_plan_world_size_is_nproc():
    cfg = load_stack("dev", ROOT)
    local = build_local_plan("dev", cfg)
    assert local.local and local.world_size == cfg.local.nproc
    assert local.model.vocab == 256
    assert local.memory.total < 4 * GIB


# -- pipeline parallel ---------------------------------------------------------------------------
FOUR = TINY.model_copy(update={"layers": 4})  # layer 0 dense, 1-3 MoE
PP_TRAIN = Training(global_batch=16, micro_batch=2, steps=10, lr=1e-3, checkpoint_interval=5)  # m = 16/(2*2) = 4


def pp_layout(schedule: str, virtual: int = 1) -> Parallel:
    return Parallel(dp_shard=2, ep=2, pp=2, pp_schedule=schedule, pp_virtual_stages=virtual, mixed_precision="fp32")


def test_pipeline_bubble_by_hand():
    hw = CATALOG["p5.48xlarge"]
    one = cap.pipeline(FOUR, pp_layout("1f1b"), PP_TRAIN)
    # 1F1B: (pp-1)/(m + pp-1) = 1/(4+1); the stages split 4 layers 2 + 2
    assert (one.micro_batches, one.stage_layers, one.bubble) == (4, [2, 2], pytest.approx(1 / 5))
    inter = cap.pipeline(FOUR, pp_layout("interleaved1f1b", 2), PP_TRAIN)
    # interleaved, v = 2: (pp-1)/(m*v + pp-1) = 1/(4*2 + 1) = 1/9; four stages of one layer
    assert (inter.stage_layers, inter.bubble) == ([1, 1, 1, 1], pytest.approx(1 / 9))
    # each of a rank's 2 stages sends 4 micro-batches of [2, 16, 64] fp32 on and their gradients back
    assert inter.p2p_bytes_per_rank == 2 * 4 * 2 * (2 * 16 * 64 * 4) == 131072
    st = step_time(FOUR, pp_layout("interleaved1f1b", 2), PP_TRAIN, hw)
    # The bubble is (pp-1) micro-batch stage-times idle: the work each micro-batch puts on the
    # critical path (compute, recompute, exposed all-to-all, TP, p2p) x (pp-1)/(m*v). It used to be
    # compute alone on top of max(compute, all communication), an overlap the trainer does not do
    # (issue 29): the FSDP traffic, once per step at pp > 1, is added outside the bubble.
    busy = st.compute_s + st.recompute_s + st.exposed_all_to_all_s + st.tensor_parallel_s + st.p2p_s
    assert st.pipeline_bubble_s == pytest.approx(busy * 1 / 8)
    assert st.step_s == pytest.approx(busy + st.exposed_fsdp_s + busy / 8)
    assert st.links["p2p"] == "NVLink"  # 4 ranks on one 8-GPU node
    flat = step_time(FOUR, Parallel(dp_shard=4, ep=2, mixed_precision="fp32"), PP_TRAIN, hw)
    assert flat.pipeline_bubble_s == 0 and flat.p2p_s == 0
    assert cap.bubble_fraction(8, 32, 1) == pytest.approx(7 / 39)  # a deeper pipeline: 7/(32+7)


def test_in_flight_activations_follow_the_schedule():
    # rank 0 at the peak: gpipe all m = 4 micro-batches, 1f1b pp = 2, interleaved
    # (v-1)*pp + 2*(pp-1) + 1 = 2 + 2 + 1 = 5 micro-batches through a one-layer virtual stage
    flights = {
        s: cap.pipeline(FOUR, pp_layout(s, v), PP_TRAIN).in_flight
        for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2))
    }
    assert flights == {"gpipe": 4, "1f1b": 2, "interleaved1f1b": 5}
    act = {
        s: memory(FOUR, pp_layout(s, v), PP_TRAIN).activations
        for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2))
    }
    # layer x micro-batch activations held: gpipe 4 x 2 layers, 1f1b 2 x 2, interleaved 5 x 1
    assert act["gpipe"] == 2 * act["1f1b"] and act["interleaved1f1b"] * 4 == act["1f1b"] * 5


def test_suggestions_consider_pipeline_stages_where_nothing_else_fits():
    # kvHeads 1 keeps tp at 1, and 48 sequences per step do not divide over dp 32 on 32 GPUs: only
    # pp fills the world (pp 2: dp 16, 3 micro-batches; pp 4: dp 8, 6 micro-batches).
    m = FOUR.model_copy(update={"kv_heads": 1, "heads": 4})
    t = Training(global_batch=48, micro_batch=1, steps=10, lr=1e-3, checkpoint_interval=5)
    p = Parallel(dp_shard=16, pp=2)
    fitting = fitting_layouts(m, p, t, CATALOG["p5.48xlarge"], cap.param_counts(m))
    assert fitting and all(s.pp >= 2 for s in fitting)
    assert {s.pp for s in fitting} == {2, 4}
    # What is offered is the Pareto front of those (this tiny model's figures all round to 0.0 s and
    # 1.5 GiB, so one layout, the simplest), every one of them a fitting layout.
    found = suggest(m, p, t, CATALOG["p5.48xlarge"], cap.param_counts(m), limit=50)
    assert found and all(s in fitting for s in found)
    for s in fitting:  # each passes the same validator as a stack's own layout
        cand = p.model_copy(
            update=dict(
                dp_replicate=s.dp_replicate,
                dp_shard=s.dp_shard,
                tp=s.tp,
                ep=s.ep,
                pp=s.pp,
                pp_schedule=s.pp_schedule,
                pp_virtual_stages=s.pp_virtual_stages,
            )
        )
        assert not layout_rules(m, cand, t.model_copy(update={"micro_batch": s.micro_batch}), 32, 8)


def test_plan_carries_the_pipeline():
    cfg = load_stack("dev", ROOT)
    cfg = cfg.model_copy(
        update={
            "parallel": cfg.parallel.model_copy(
                update={
                    "pp": 2,
                    "tp": 1,
                    "dp_shard": 8,
                    "ep": 8,
                    "pp_schedule": "interleaved1f1b",
                    "pp_virtual_stages": 2,
                }
            )
        }
    )
    plan = build_plan("dev", cfg)
    # 128 sequences / (4 x dp 8) = 4 micro-batches; 12 layers over 4 stages
    assert (plan.degrees.pp, plan.pipeline.schedule, plan.pipeline.virtual_stages) == (2, "interleaved1f1b", 2)
    assert plan.pipeline.micro_batches == plan.micro_batches_per_step == 4
    assert plan.pipeline.stage_layers == [3, 3, 3, 3] and plan.pipeline.bubble == pytest.approx(1 / 9)
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("fits", [True, False])
def test_one_plan_build_is_one_pass_of_the_estimate(monkeypatch, fits):
    """Parameter counts -> pipeline -> memory -> step time, each computed once per plan and handed
    on; the suggestions (a plan that does not fit) reuse the plan's counts for every candidate."""
    calls: dict[str, int] = {}

    def counted(name):
        real = getattr(cap, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(cap, name, wrapper)

    for name in ("param_counts", "pipeline", "memory", "step_time"):
        counted(name)
    cfg = load_stack("prod", ROOT)
    if not fits:  # prod's layout on A100 40 GB
        groups = [g.model_copy(update={"instance_type": "p4d.24xlarge"}) for g in cfg.accelerator_node_groups]
        cfg = cfg.model_copy(update={"accelerator_node_groups": groups})
    plan = build_plan("prod", cfg)
    assert plan.fits == fits and bool(plan.suggestions) != fits
    assert calls["param_counts"] == 1
    if fits:
        # One pass for the planned world (costed once, the plan reads its layout) and one per
        # candidate of each other world of prod's elastic range (training.minNodes 8: 8..15 nodes, each
        # tried with 2 replicas and with 1: every world there is even).
        assert len(plan.layouts) == 9
        passes = 1 + 8 * 2
        assert calls == {"param_counts": 1, "pipeline": passes, "memory": passes, "step_time": passes}


# -- step time as the trainer runs it (issue 29) ------------------------------------------------------
H100 = CATALOG["p5.48xlarge"]
FLOP_S = H100.peak_flops * cap.MATMUL_EFFICIENCY  # uncalibrated: 989 TFLOP/s x 0.55


def _with(p: Parallel, **update) -> Parallel:
    return p.model_copy(update=update)


def test_recomputation_by_checkpointing_mode_by_hand():
    """full re-runs every block's forward (Block.forward under torch.utils.checkpoint), selective
    only the FFN/MoE layer's (Block._ffn); both re-run the MoE dispatch and combine."""
    st = {ac: step_time(TINY, _with(FP32_EP2, activation_checkpointing=ac), TRAIN, H100) for ac in cap.AC_MODES}
    tokens, world = 4 * 16, 2
    # selective: 2 FLOPs x (router 256 + top-2 of 4 experts 24576 * 2/4 + shared 6144 + dense FFN 24576)
    assert st["selective"].recompute_s == pytest.approx(tokens * 2 * (256 + 12288 + 6144 + 24576) / world / FLOP_S)
    # full: a third of the blocks' FLOPs, 459648 per token less the head and final norm 6 x (100*64 + 64)
    assert st["full"].recompute_s == pytest.approx(tokens * (459648 - 6 * 6464) / 3 / world / FLOP_S)
    assert st["none"].recompute_s == 0 and st["none"].recompute_all_to_all_s == 0
    for ac in ("selective", "full"):  # the forward's two of the four all-to-alls, again
        assert st[ac].recompute_all_to_all_s == pytest.approx(st[ac].all_to_all_s / 2)
    # (This tiny model's FSDP traffic outlasts its compute, so longer compute hides as much of it as
    # it adds: the step-time order is checked on prod, below.)


def test_prod_step_time_differs_by_the_recomputation_it_costs():
    """The issue's case: prod's step time was 3.7297 s for none, selective and full alike."""
    cfg = load_stack("prod", ROOT)
    plans = {
        ac: build_plan("prod", cfg.model_copy(update={"parallel": _with(cfg.parallel, activation_checkpointing=ac)}))
        for ac in cap.AC_MODES
    }
    st = {ac: plan.step for ac, plan in plans.items()}
    # With every micro-batch's gradients reduce-scattered (trainer/engine.py), prod's 8 micro-batches make
    # it EFA-bound once it recomputes (the test below): full's extra recomputation hides behind EFA
    # traffic selective already waits for, so full is no faster, and no slower, than selective.
    assert st["none"].step_s < st["selective"].step_s <= st["full"].step_s
    pc, tokens, world = plans["none"].params, 1024 * 4096, 128
    # selective re-runs the MoE/FFN forward: 2 x (router + 6 of 128 experts + 2 shared + the dense FFN)
    ffn = pc.router + pc.experts * 6 // 128 + pc.shared_experts + pc.dense_ffn
    assert st["selective"].recompute_s == pytest.approx(tokens * 2 * ffn / world / FLOP_S)
    # full re-runs the blocks' forward: 1/3 of the FLOPs per token less the head and final norm
    blocks = plans["none"].flops_per_token - 6 * (128000 * 5120 + 5120)
    assert st["full"].recompute_s == pytest.approx(tokens * blocks / 3 / world / FLOP_S)
    # the difference from none: the recomputed FLOPs, the re-run dispatch and combine less what the
    # shared expert hides of the re-run dispatch, and the FSDP traffic the longer compute now hides
    for ac in ("selective", "full"):
        hidden = st["none"].all_to_all_s + 0 - st["none"].exposed_all_to_all_s  # one forward's hidden dispatch
        assert st[ac].step_s - st["none"].step_s == pytest.approx(
            st[ac].recompute_s
            + st[ac].recompute_all_to_all_s
            - hidden
            + st[ac].exposed_fsdp_s
            - st["none"].exposed_fsdp_s
        )


def test_all_to_all_and_fsdp_over_the_same_efa_do_not_hide_in_the_same_seconds():
    """Prod's ep 16 spans two instances and its FSDP/HSDP rings cross EFA: both use each GPU's share
    of the instance's EFA, so the all-to-all that hides behind compute leaves that time to FSDP no
    more. The step is then at least all the EFA traffic end to end (it was 9.67 s, less than that)."""
    cfg = load_stack("prod", ROOT)
    st = build_plan("prod", cfg).step
    assert "EFA" in st.links["all_to_all"] and "EFA" in st.links["replicate"]
    network = st.fsdp_s + st.replicate_s + st.all_to_all_s + st.recompute_all_to_all_s
    assert st.step_s >= network - 1e-9
    # Inside one instance (ep 8 on NVLink) the all-to-all leaves EFA to FSDP: no such floor.
    inside = build_plan("prod", cfg.model_copy(update={"parallel": _with(cfg.parallel, ep=8)})).step
    assert inside.links["all_to_all"] == "NVLink"
    assert inside.step_s < inside.fsdp_s + inside.replicate_s + inside.all_to_all_s + inside.recompute_all_to_all_s


def test_only_the_overlap_the_trainer_does_is_credited():
    """AllToAllDispatcher.compute: without parallel.overlap every all-to-all waits. With it, in
    forward only, dispatch 0 runs beside the shared expert and, in K = allToAllChunks pieces, piece i's
    experts run beside combine i-1 and dispatch i+1; the last combine and backward's all-to-alls
    wait. FSDP's forward gathers are prefetched only with overlap."""
    p = _with(FP32_EP2, dp_shard=8, ep=8)
    off = step_time(TINY, _with(p, overlap=False), TRAIN, H100)
    assert off.exposed_all_to_all_s == pytest.approx(off.all_to_all_s)
    shared_fwd = 4 * 16 * 2 * 6144 / 8 / FLOP_S  # the shared expert's forward, per rank
    experts_fwd = 4 * 16 * 2 * (4 * 3 * 64 * 32 * 2 // 4) / 8 / FLOP_S  # 2 of 4 routed experts' forward
    a2a = off.all_to_all_s
    for k, schedule in {
        1: [0],  # what waits beside each piece's experts: nothing but the shared expert hides anything
        2: [1, 1],  # piece 0 beside dispatch 1, piece 1 beside combine 0
        3: [1, 2, 1],  # piece 1 beside combine 0 and dispatch 2
        5: [1, 2, 2, 2, 1],
    }.items():
        on = step_time(TINY, _with(p, all_to_all_chunks=k), TRAIN, H100)
        piece, experts = a2a / 4 / k, experts_fwd / k
        exposed_forward = max(0.0, piece - shared_fwd) + sum(max(0.0, n * piece - experts) for n in schedule) + piece
        assert on.all_to_all_s == pytest.approx(a2a)
        assert on.exposed_all_to_all_s == pytest.approx(a2a / 2 + exposed_forward), f"{k} chunks"
    # More pieces hide more while the experts outlast what queues beside them (wide experts);
    # once communication outlasts every piece's experts, the pieces hide the experts' time and no more.
    wide = TINY.model_copy(update={"expert_hidden": 4096})
    chunked = [step_time(wide, _with(p, all_to_all_chunks=k), TRAIN, H100).exposed_all_to_all_s for k in (1, 2, 4)]
    assert chunked[0] > chunked[1] > chunked[2] > a2a / 2
    bound = [step_time(TINY, _with(p, all_to_all_chunks=k), TRAIN, H100).exposed_all_to_all_s for k in (2, 4)]
    assert bound[0] == pytest.approx(bound[1]) == pytest.approx(a2a - experts_fwd - shared_fwd)
    # No expert parallel: nothing to hide, whatever the chunks.
    assert step_time(TINY, _with(FP32_EP2, ep=1, all_to_all_chunks=4), TRAIN, H100).exposed_all_to_all_s == 0.0
    cfg = load_stack("prod", ROOT)
    # One micro-batch per step (8 sequences per rank): compute-bound enough for FSDP's prefetch to matter.
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"micro_batch": 8})})
    prod = {
        overlap: build_plan("prod", cfg.model_copy(update={"parallel": _with(cfg.parallel, overlap=overlap)})).step
        for overlap in (True, False)
    }
    assert prod[True].exposed_fsdp_s < prod[False].exposed_fsdp_s <= prod[False].fsdp_s + prod[False].replicate_s
    assert prod[True].step_s < prod[False].step_s
    for st in (on, off, *prod.values()):  # the step is the sum of its exposed terms: no max(compute, comm)
        assert st.step_s == pytest.approx(
            st.compute_s + st.recompute_s + st.exposed_all_to_all_s + st.exposed_fsdp_s + st.tensor_parallel_s
        )


def test_fsdp_all_gathers_repeat_per_micro_batch_at_pp_1():
    """trainer/engine.py reduce-scatters every micro-batch's gradients (a rank holds only its gradient
    shard): every micro-batch gathers each block in forward and backward again and reduce-scatters."""
    p = _with(FP32_EP2, dp_shard=2, ep=2)
    one = step_time(TINY, p, TRAIN.model_copy(update={"micro_batch": 2}), H100)  # 4 / (2 x 2) = 1 micro-batch
    two = step_time(TINY, p, TRAIN.model_copy(update={"micro_batch": 1}), H100)  # 2 micro-batches
    pc = cap.param_counts(TINY)
    ring = 2 * 450e9  # a ring of 2 on NVLink moves half the buffer at 450 GB/s one way
    # fp32: the non-expert weights (68672); ep = dp_shard leaves the experts out of FSDP (no replicas)
    gather = (pc.total - pc.experts) * 4
    gather_bwd = gather - (pc.embedding + pc.head + 64) * 4  # the root stays gathered after forward
    assert one.fsdp_s == pytest.approx((gather + gather_bwd + gather) / ring)  # + the fp32 reduce-scatter
    assert two.fsdp_s == pytest.approx(2 * (gather + gather_bwd + gather) / ring)


# -- suggestions (issue 29) ---------------------------------------------------------------------------
def _prod_over(instance_type: str = "p5.48xlarge", micro_batch: int = 4):
    cfg = load_stack("prod", ROOT)
    groups = [g.model_copy(update={"instance_type": instance_type}) for g in cfg.accelerator_node_groups]
    return cfg.model_copy(
        update={
            "accelerator_node_groups": groups,
            "parallel": _with(cfg.parallel, dp_replicate=16, dp_shard=8, ep=8, activation_checkpointing="none"),
            "training": cfg.training.model_copy(update={"micro_batch": micro_batch, "global_batch": 1024}),
        }
    )


def test_suggestions_are_the_pareto_front_ranked_by_step_time():
    cfg = _prod_over()
    plan = build_plan("prod", cfg)
    found = suggest(cfg.model, cfg.parallel, cfg.training, H100, plan.params, limit=50, domain=8)
    assert not plan.fits and len(found) > 1
    for a in found:  # none is slower and larger than (or as slow and as large as) another
        for b in found:
            if a is not b:
                assert a.step_s < b.step_s or a.memory_gib < b.memory_gib, (a, b)
    inside = [s for s in found if s.ep_inside_domain]
    assert [s.step_s for s in inside] == sorted(s.step_s for s in inside)  # fastest first
    assert plan.suggestions == found[:3]


def test_suggestions_lower_the_micro_batch_where_the_stacks_does_not_fit():
    """prod at microBatch 4 on A100 40 GB: the logits alone leave no layout at 4; one at a lower
    microBatch (more accumulation) fits, and the plan of that suggestion says so."""
    cfg = _prod_over("p4d.24xlarge", micro_batch=4)
    plan = build_plan("prod", cfg)
    assert not plan.fits and plan.suggestions
    for s in plan.suggestions:
        assert s.micro_batch < 4 and s.micro_batches == 1024 // (s.micro_batch * s.dp_replicate * s.dp_shard)
        layout = {k: getattr(s, k) for k in ("dp_replicate", "dp_shard", "tp", "ep", "pp", "pp_schedule")}
        again = cfg.model_copy(
            update={
                "parallel": _with(
                    cfg.parallel,
                    **layout,
                    pp_virtual_stages=s.pp_virtual_stages,
                    activation_checkpointing=s.activation_checkpointing,
                ),
                "training": cfg.training.model_copy(update={"micro_batch": s.micro_batch}),
            }
        )
        rebuilt = build_plan("prod", again)
        assert rebuilt.fits and round(rebuilt.memory_per_rank_gib, 2) == s.memory_gib
        assert round(rebuilt.step.step_s, 4) == s.step_s


def test_world_size_message_offers_only_an_integer_dp_shard():
    m, t = TINY, TRAIN.model_copy(update={"global_batch": 48, "micro_batch": 1})
    (issue,) = [i for i in layout_rules(m, Parallel(dp_replicate=3, dp_shard=2), t, 16, 8) if "world" in i.message]
    assert "5.3" not in issue.message and "no integer dpShard matches" in issue.message
    assert "multiple of the other degrees' 3" in issue.message
    (issue,) = [i for i in layout_rules(m, Parallel(dp_replicate=2, dp_shard=2), t, 16, 8) if "world" in i.message]
    assert "dpShard = 8 would match" in issue.message
