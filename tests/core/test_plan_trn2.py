"""Trainium2 from catalog to plan: the catalog rows against AWS's published figures (written here
independently of the catalog), a rank as a logical NeuronCore, TP on one chip against TP across chips
by hand, a Trn2 UltraServer's slower link between its instances, the refusal of EP/TP groups that leave
their NeuronLink domain, suggestions under the same rule, and the trn2 stack's plan checked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from supernode.core import capacity as cap
from supernode.core.catalog import CATALOG, GIB, ULTRASERVERS, nvlink_domain_gpus
from supernode.core.config import Model, Parallel, Training, load_stack
from supernode.core.errors import BadInput
from supernode.core.plan import build_plan
from supernode.core.search import fitting_layouts

ROOT = Path(__file__).resolve().parents[2]
TRN2, TRN2U = CATALOG["trn2.48xlarge"], CATALOG["trn2u.48xlarge"]

# AWS's published figures (awsdocs-neuron: trainium2 architecture, trn2-arch "Trn2 instance specifications").
CHIPS_PER_INSTANCE = 16
CHIP_HBM_GIB = 96
CHIP_HBM_TB_S = 2.9  # 46.4 TB/s per instance / 16
CHIP_BF16_TFLOPS = 667  # dense; 10.7 PFLOP/s per instance
CHIP_NEURONLINK_GB_S = 1024  # inside an instance
CHIP_NEURONLINK_BETWEEN_INSTANCES_GB_S = 256  # inside a Trn2 UltraServer
EFA_GBPS_PER_INSTANCE = 3200  # EFAv3, 16 x 200 Gb/s (EC2: 16 network cards of 200 Gb/s)
LNC2_LOGICAL_CORES_PER_CHIP = 4  # 8 NeuronCore-v3, two per logical core
ULTRASERVER_INSTANCES = 4
ULTRASERVER_HBM_GIB = 6144


def test_catalog_holds_awss_trainium2_figures_per_logical_core():
    for hw in (TRN2, TRN2U):
        assert hw.vendor == "neuron" and hw.accelerator == "Trainium2"
        assert hw.chips == CHIPS_PER_INSTANCE and hw.ranks_per_chip == LNC2_LOGICAL_CORES_PER_CHIP
        assert hw.accelerators == CHIPS_PER_INSTANCE * LNC2_LOGICAL_CORES_PER_CHIP == 64  # ranks per instance
        assert hw.hbm_gib == CHIP_HBM_GIB / LNC2_LOGICAL_CORES_PER_CHIP == 24
        assert hw.hbm_gbytes_s == pytest.approx(CHIP_HBM_TB_S * 1000 / 4)
        assert hw.peak_flops * hw.accelerators == pytest.approx(CHIPS_PER_INSTANCE * CHIP_BF16_TFLOPS * 1e12)
        assert hw.nvlink_gbytes_s * hw.ranks_per_chip == CHIP_NEURONLINK_GB_S
        assert hw.efa_gbytes_s * 8 == EFA_GBPS_PER_INSTANCE and hw.efa_interfaces == 16
        assert hw.device_resource == "aws.amazon.com/neurondevice" and hw.link_name == "NeuronLink"
        assert hw.torch_device == "neuron" and hw.arch == "x86_64" and hw.neuron_cores_per_chip == 8
    assert TRN2.domain_inter_node_gbytes_s is None
    assert TRN2U.domain_inter_node_gbytes_s * TRN2U.ranks_per_chip == CHIP_NEURONLINK_BETWEEN_INSTANCES_GB_S
    u = ULTRASERVERS["u-trn2x64"]
    assert (u.instance_type, u.instances) == ("trn2u.48xlarge", ULTRASERVER_INSTANCES)
    assert nvlink_domain_gpus("trn2u.48xlarge", "u-trn2x64") == 256 and nvlink_domain_gpus("trn2.48xlarge") == 64
    assert 256 * TRN2U.hbm_gib == ULTRASERVER_HBM_GIB  # the domain's "global address space"


def test_pods_request_whole_neuron_devices():
    pod = cap.PodShape.for_node(TRN2, hugepages_gib=4)
    assert (pod.gpus, pod.device_resource, pod.efa) == (16, "aws.amazon.com/neurondevice", 16)
    assert pod.times(4).gpus == 64 and pod.times(4).device_resource == "aws.amazon.com/neurondevice"
    assert cap.PodShape.for_node(CATALOG["p5.48xlarge"], 4).device_resource == "nvidia.com/gpu"


# 4 layers of MoE, small enough to hand-compute.
MOE = Model(
    layers=4,
    dim=2048,
    heads=16,
    kv_heads=8,
    experts=64,
    top_k=4,
    expert_hidden=512,
    dense_hidden=4096,
    vocab=1000,
    seq_len=1024,
)
TRAIN = Training(global_batch=64, micro_batch=1, steps=10, lr=1e-3, checkpoint_interval=5)


def step(p: Parallel, hw=TRN2, domain: int | None = None) -> cap.StepTime:
    return cap.step_time(MOE, p, TRAIN, hw, cap.param_counts(MOE), cap.pipeline(MOE, p, TRAIN), domain)


def tp_bytes(p: Parallel) -> float:
    """The TP volume per step as the planner states it: 4 x layers x 2 x tokens per rank x dim x 2 B."""
    tokens_rank = TRAIN.global_batch * MOE.seq_len / p.dp
    return 4 * MOE.layers * 2 * tokens_rank * MOE.dim * 2


def test_tp_inside_a_chip_is_costed_on_the_chip_and_compared_with_tp_across_chips():
    p = Parallel(dp_shard=16, tp=4, ep=4)  # 64 ranks: one instance
    s = step(p)
    chip = s.chip_tensor_parallel
    assert chip is not None and chip.inside_chip and chip.tp == 4
    # ring over 4 members: 3/4 of the buffer, at the core's share of HBM (725 GB/s) on the chip and at its
    # share of NeuronLink in one direction (1,024 / 4 / 2 = 128 GB/s) across chips
    assert chip.inside_chip_s == pytest.approx(tp_bytes(p) * 3 / 4 / 725e9)
    assert chip.across_chips_s == pytest.approx(tp_bytes(p) * 3 / 4 / 128e9)
    assert s.tensor_parallel_s == pytest.approx(chip.inside_chip_s) and s.links["tensor_parallel"] == "on-chip"
    assert chip.across_chips_s / chip.inside_chip_s == pytest.approx(725 / 128)


def test_tp_wider_than_a_chip_pays_neuronlink_and_no_chip_holds_it():
    p = Parallel(dp_shard=8, tp=8, ep=8)
    s = step(p)
    chip = s.chip_tensor_parallel
    assert not chip.inside_chip and chip.inside_chip_s is None
    assert s.tensor_parallel_s == pytest.approx(tp_bytes(p) * 7 / 8 / 128e9) == pytest.approx(chip.across_chips_s)
    assert s.links["tensor_parallel"] == "NeuronLink"


def test_gpus_have_no_chip_comparison():
    assert step(Parallel(dp_shard=4, tp=2, ep=2), CATALOG["p5.48xlarge"]).chip_tensor_parallel is None


def test_an_ultraserver_group_that_leaves_its_instance_runs_at_the_link_between_instances():
    p = Parallel(dp_shard=256, tp=1, ep=64)
    inside = step(p, TRN2U, 256)  # each EP group of 64 consecutive ranks lies on one instance
    a2a_bytes = inside.all_to_all_bytes_per_rank
    assert inside.all_to_all_s == pytest.approx(a2a_bytes / 128e9)
    across = step(Parallel(dp_shard=256, tp=1, ep=256), TRN2U, 256)  # spans the 4 instances
    assert across.links["all_to_all"] == "NeuronLink"
    assert across.all_to_all_s == pytest.approx(across.all_to_all_bytes_per_rank / (256e9 / 4 / 2))


def stack(**parallel):
    cfg = load_stack("trn2", ROOT)
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update=parallel)})


def test_the_trn2_stack_plan_by_hand():
    plan = build_plan("trn2", load_stack("trn2", ROOT))
    assert plan.world_size == 256 and plan.accelerators_per_node == 64 and plan.nodes == 4
    assert plan.topology.ultra_server == "u-trn2x64" and plan.topology.domain_gpus == 256
    assert plan.topology.nodes_per_domain == 4 and plan.topology.domain_hbm_gib == ULTRASERVER_HBM_GIB
    assert plan.hbm_gib == 24 and plan.usable_hbm_gib == pytest.approx(24 * 0.9)
    assert plan.fits and plan.memory_per_rank_gib < plan.usable_hbm_gib
    # compute: 6 x active + attention FLOPs per token, 1024 x 4096 tokens over 256 ranks at 55% of 166.75 TFLOP/s
    tokens = 1024 * 4096
    assert plan.step.compute_s == pytest.approx(tokens * plan.flops_per_token / 256 / (0.55 * 667e12 / 4))
    assert plan.cost_per_hour_usd == pytest.approx(4 * 35.76)
    assert plan.pod.gpus == 16 and plan.pod.device_resource == "aws.amazon.com/neurondevice"
    chip = plan.step.chip_tensor_parallel
    assert chip.inside_chip and chip.across_chips_s > 5 * chip.inside_chip_s
    assert {g.dim: g.inside_domain for g in plan.layout.placement}["ep"]
    assert plan.gate_floor_gbytes_s == pytest.approx(300 * 0.8)


def test_ep_leaving_the_neuronlink_domain_is_refused_naming_the_key():
    cfg = stack(dp_shard=64, tp=4, ep=256)
    cfg = cfg.model_copy(
        update={
            "accelerator_node_groups": [
                g.model_copy(update={"instance_type": "trn2.48xlarge", "ultra_server": None, "capacity": g.capacity})
                for g in cfg.accelerator_node_groups
            ]
        }
    )
    with pytest.raises(BadInput) as e:
        build_plan("trn2", cfg)
    msg = str(e.value)
    assert msg.startswith("supernode:parallel.ep: 256 puts each ep group across 4 NeuronLink domains of 64")
    assert "logical NeuronCores (one trn2.48xlarge)" in msg and "choose supernode:parallel.ep dividing 64" in msg


def test_the_domain_rule_covers_ep_and_tp_on_trainium_only():
    """Issue 35: the rule had three copies beside the plan's (elastic layouts, suggestions), and the
    suggestions' checked EP only. `domain_rules` is the one the plan, the elastic layouts and the
    suggestions ask."""
    from supernode.core.layout import domain_rules

    tp_leaves = Parallel(dp_shard=16, tp=8, ep=4)  # tp 8 over domains of 4 ranks: two domains per group
    both_leave = Parallel(dp_shard=16, tp=8, ep=16)
    issues = domain_rules(tp_leaves, TRN2, 4, "one test domain")
    assert [(i.path, i.value) for i in issues] == [("supernode:parallel.tp", 8)]
    assert "8 puts each tp group across 2 NeuronLink domains of 4 logical NeuronCores (one test domain)" in str(
        issues[0]
    )
    assert {i.path.rsplit(".", 1)[1] for i in domain_rules(both_leave, TRN2, 4)} == {"ep", "tp"}
    assert domain_rules(both_leave, CATALOG["p5.48xlarge"], 4) == []  # GPUs cost EP/TP over EFA instead
    assert domain_rules(both_leave, TRN2, 128) == []


def test_suggestions_for_trainium_keep_ep_inside_the_domain():
    m = Model(
        layers=2,
        dim=1024,
        heads=16,
        kv_heads=8,
        experts=128,
        top_k=8,
        expert_hidden=512,
        dense_hidden=2048,
        vocab=1000,
        seq_len=1024,
    )
    t = Training(global_batch=128, micro_batch=1, steps=10, lr=1e-3, checkpoint_interval=5)
    p = Parallel(dp_shard=128, ep=128)  # two trn2.48xlarge: EP 128 would span both domains
    found = fitting_layouts(m, p, t, TRN2, cap.param_counts(m), domain=64)
    assert found and all(s.ep_inside_domain and 64 % s.ep == 0 for s in found)
    gpu = fitting_layouts(m, p, t, CATALOG["p5.48xlarge"], cap.param_counts(m), domain=8)
    assert any(not s.ep_inside_domain for s in gpu)  # GPUs may cost EP over EFA; Trainium may not


def test_memory_per_rank_is_against_a_logical_cores_share_of_hbm():
    """The same layout on 64 GiB less per rank: a trn2 rank has 24 GiB, an H100 80."""
    cfg = load_stack("trn2", ROOT)
    plan = build_plan("trn2", cfg)
    assert plan.usable_hbm_gib * GIB == cap.usable_hbm_bytes(cfg.parallel, TRN2U)
    assert plan.hbm_gib * 4 == CHIP_HBM_GIB
