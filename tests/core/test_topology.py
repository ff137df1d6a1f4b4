"""NVLink domains in the plan: catalog facts, placement of the mesh on domains, the hierarchical
communication cost against a hand computation, layout rules at domain size, suggestions that keep EP
inside the domain, the UltraServer config rules, and the trainer's rank order for 144 ranks."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from supernode.core import capacity as cap
from supernode.core.catalog import CATALOG, ULTRASERVERS, nvlink_domain_gpus
from supernode.core.config import ConfigError, Model, Parallel, Training, from_mapping, load_stack, read_stack_file
from supernode.core.layout import layout_rules
from supernode.core.plan import build_plan
from supernode.core.search import suggest
from supernode.core.topology import group_span, place, rank_order

ROOT = Path(__file__).resolve().parents[2]
GB200 = CATALOG["p6e-gb200.36xlarge"]
NVL72 = 72
# 2 layers, both MoE; 144 experts so ep 72 and ep 144 both divide them.
MOE = Model(
    layers=2,
    dim=1024,
    heads=16,
    kv_heads=8,
    experts=144,
    top_k=8,
    expert_hidden=512,
    dense_hidden=2048,
    vocab=1000,
    seq_len=1024,
)
TRAIN = Training(global_batch=144, micro_batch=1, steps=10, lr=1e-3, checkpoint_interval=5)


def step_time(m: Model, p: Parallel, t: Training, hw, domain: int | None = None) -> cap.StepTime:
    """The estimate's step-time step, handed the counts and the pipeline shape as a plan build hands them."""
    return cap.step_time(m, p, t, hw, cap.param_counts(m), cap.pipeline(m, p, t), domain)


def test_catalog_holds_the_supernode_facts():
    """docs/hardware.md, written independently of the catalog."""
    assert ULTRASERVERS["u-p6e-gb200x72"].gpus == 72 and ULTRASERVERS["u-p6e-gb200x36"].gpus == 36
    assert nvlink_domain_gpus("p6e-gb200.36xlarge", "u-p6e-gb200x72") == 72
    assert nvlink_domain_gpus("p6-b300.48xlarge") == nvlink_domain_gpus("p5.48xlarge") == 8
    assert GB200.arch == "arm64" and GB200.accelerators == 4 and not GB200.card0_efa
    b300, b200 = CATALOG["p6-b300.48xlarge"], CATALOG["p6-b200.48xlarge"]
    assert (b300.network_cards, b300.efa_interfaces, b300.card0_efa) == (17, 16, False)
    assert (b200.network_cards, b200.efa_interfaces, b200.card0_efa) == (8, 8, True)
    assert b300.efa_gbytes_s * 8 == 6400 and b200.efa_gbytes_s * 8 == 3200  # Gb/s per instance (moto)


def test_group_span_counts_domains_and_members():
    assert group_span(72, 1, 144, 72) == (1, 72)  # one EP group per NVL72
    assert group_span(144, 1, 144, 72) == (2, 72)  # spans both
    assert group_span(48, 1, 144, 72) == (2, 24)  # 48..95 straddles the boundary: the worst group
    assert group_span(2, 72, 144, 72) == (2, 1)  # dp_replicate across the two domains
    assert group_span(16, 1, 128, 8) == (2, 8)  # prod's EP 16 on p5: two nodes of 8


def test_placement_of_the_gb200_stack_keeps_ep_and_fsdp_inside_the_domain():
    plan = build_plan("gb200", load_stack("gb200", ROOT))
    topo, layout = plan.topology, plan.layout
    assert (topo.ultra_server, topo.domain_gpus, topo.nodes_per_domain, layout.domains) == ("u-p6e-gb200x72", 72, 18, 2)
    assert topo.domain_hbm_gib == pytest.approx(72 * GB200.hbm_gib)
    assert layout.group("ep").inside_domain and layout.group("ep").size == 72
    assert layout.group("dp_shard").inside_domain
    rep = layout.group("dp_replicate")
    assert (rep.domains, rep.per_domain, rep.link) == (2, 1, "EFA")
    assert plan.step.links == {"all_to_all": "NVLink", "fsdp": "NVLink", "replicate": "EFA"}
    # one replica (16 B per parameter) on its 72 GPUs of one domain
    assert layout.replica_domains == 1 and layout.replica_fits
    assert topo.replica_state_gib == pytest.approx(16 * plan.params.total / 2**30)
    assert 300e9 <= plan.params.total <= 700e9 and plan.world_size == 144 and plan.fits


def test_all_to_all_inside_one_nvl72_versus_spanning_two_by_hand():
    """Each rank sends V bytes to its n-1 peers, V/(n-1) each: the m-1 peers in its domain over NVLink
    (900 GB/s one way), the n-m others over EFA (4 x 400 Gb/s per 4-GPU node = 50 GB/s per GPU)."""
    nvlink, efa = 1800e9 / 2, 4 * 400 / 8 * 1e9 / 4
    inside = step_time(MOE, Parallel(dp_shard=144, ep=72), TRAIN, GB200, NVL72)
    across = step_time(MOE, Parallel(dp_shard=144, ep=144), TRAIN, GB200, NVL72)
    tokens_rank = 144 * 1024 / 144
    v72 = int(4 * tokens_rank * 8 * 1024 * 2 * 71 / 72 * 2)  # 4 passes x tokens x topK x dim x bf16 x (n-1)/n x layers
    v144 = int(4 * tokens_rank * 8 * 1024 * 2 * 143 / 144 * 2)
    assert inside.all_to_all_bytes_per_rank == v72 and across.all_to_all_bytes_per_rank == v144
    assert inside.all_to_all_s == pytest.approx(v72 / nvlink)
    assert across.all_to_all_s == pytest.approx(v144 * 71 / 143 / nvlink + v144 * 72 / 143 / efa)
    assert inside.links["all_to_all"] == "NVLink" and across.links["all_to_all"] == "NVLink+EFA"
    # not all-or-nothing: cheaper than the same bytes all over EFA, dearer than all over NVLink
    assert v144 / nvlink < across.all_to_all_s < v144 / efa


def test_ring_collectives_are_hierarchical_by_hand():
    """FSDP over 144 ranks in 2 domains: a ring of 72 on NVLink, then each GPU's 1/72 share across 2 domains."""
    nvlink, efa = 900e9, 50e9
    p = Parallel(dp_shard=144, ep=72)
    st = step_time(MOE, p, TRAIN, GB200, NVL72)
    pc = cap.param_counts(MOE)
    # all-gathers fwd + bwd (bf16) and reduce-scatter (fp32), less the root's (embedding, head, final
    # norm) backward all-gather: FSDP2 keeps the root gathered after forward (reshard_after_forward=False)
    buf_dense = (pc.total - pc.experts) * (2 * 2 + 4) - (pc.embedding + pc.head + 1024) * 2
    buf_experts = pc.experts / 72 * (2 * 2 + 4)  # edp = 2, stride 72: one member per domain
    want = (buf_dense * 71 / 72 / nvlink + buf_dense / 72 * 1 / 2 / efa) + buf_experts * 1 / 2 / efa
    assert st.fsdp_s == pytest.approx(want)
    assert st.links["fsdp"] == "NVLink+EFA" and st.links["fsdp_experts"] == "EFA"


def test_single_node_domains_keep_the_old_figures_inside_a_node():
    """p5 (8-GPU domains): a group inside the node costs exactly what the node-only rule charged."""
    hw = CATALOG["p5.48xlarge"]
    m = MOE.model_copy(update={"experts": 8})
    t = Training(global_batch=8, micro_batch=1, steps=1, lr=1e-3, checkpoint_interval=1)
    st = step_time(m, Parallel(dp_shard=8, ep=8), t, hw)
    assert st.all_to_all_s == pytest.approx(st.all_to_all_bytes_per_rank / (hw.nvlink_gbytes_s * 1e9 / 2))
    assert set(st.links.values()) == {"NVLink"}


def test_layout_rules_allow_tp_up_to_the_domain():
    m = MOE.model_copy(update={"heads": 64, "kv_heads": 16})
    p = Parallel(dp_shard=9, tp=16, ep=144)
    assert not [i for i in layout_rules(m, p, TRAIN, 144, max_tp=72) if i.path.endswith("parallel.tp")]
    issues = [i for i in layout_rules(m, p, TRAIN, 144, max_tp=8) if i.path.endswith("parallel.tp")]
    assert [i.message for i in issues] == ["tensor parallel must stay inside an NVLink domain (<= 8 GPUs)"]


def gb200_data() -> dict:
    return read_stack_file(ROOT / "Pulumi.gb200.yaml")


def issues(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        from_mapping(data)
    return {i.path: i.message for i in e.value.issues}


def test_gb200_stack_loads_with_local_zone_and_tp_at_domain_size():
    data = gb200_data()
    data["model"].update(heads=64, kvHeads=16)
    data["parallel"].update(tp=16, dpReplicate=1, dpShard=9, ep=16)  # tp 16 > a 4-GPU node, inside the 72-GPU domain
    data["local"]["parallel"]["tp"] = 1
    cfg = from_mapping(data)
    assert cfg.availability_zone == "us-east-1-dfw-2a"
    assert [g.nvlink_domain for g in cfg.accelerator_node_groups] == [72, 72]


@pytest.mark.parametrize(
    "change,path,says",
    [
        (lambda g: g.pop("ultraServer"), "acceleratorNodeGroups[0].ultraServer", "sold only as UltraServers"),
        (lambda g: g.update(nodes=17), "acceleratorNodeGroups[0].nodes", "nodes must be 18"),
        (lambda g: g.update(ultraServer="u-p6e-gb200x36"), "acceleratorNodeGroups[0].nodes", "nodes must be 9"),
        (
            lambda g: g.update(capacity={"type": "on-demand"}),
            "acceleratorNodeGroups[0].capacity.type",
            "sold as Capacity Blocks",
        ),
        (
            lambda g: g.update(ultraServer="u-p6e-gb200x144"),
            "acceleratorNodeGroups[0].ultraServer",
            "not a known UltraServer type",
        ),
    ],
)
def test_ultraserver_rules_name_path_and_fix(change, path, says):
    data = gb200_data()
    change(data["acceleratorNodeGroups"][0])
    found = issues(data)
    assert says in found[f"supernode:{path}"], found


def test_local_zone_only_for_the_gpu_nodes():
    data = gb200_data()
    data["network"]["availabilityZones"] = ["us-east-1-dfw-2a", "us-east-1b"]
    assert "supernode:network.availabilityZones[0]" in issues(data)


def test_suggestions_prefer_ep_inside_the_domain():
    cfg = load_stack("gb200", ROOT)
    # no activation checkpointing and 4 sequences per micro batch: over the HBM
    cfg = cfg.model_copy(
        update={
            "parallel": cfg.parallel.model_copy(update={"activation_checkpointing": "none"}),
            "training": cfg.training.model_copy(update={"micro_batch": 8}),
        }
    )
    plan = build_plan("gb200", cfg)
    assert not plan.fits and plan.suggestions
    sug = suggest(cfg.model, cfg.parallel, cfg.training, GB200, cap.param_counts(cfg.model), limit=50, domain=NVL72)
    inside = [s.ep_inside_domain for s in sug]
    assert inside == sorted(inside, reverse=True) and inside[0]  # every EP-inside layout before any crossing one
    for s in plan.suggestions:
        p = cfg.parallel.model_copy(update=dict(dp_replicate=s.dp_replicate, dp_shard=s.dp_shard, tp=s.tp, ep=s.ep))
        assert next(g for g in place(p, NVL72) if g.dim == "ep").inside_domain == s.ep_inside_domain


# -- the trainer's rank order -----------------------------------------------------------------------


def test_rank_order_puts_every_ep_group_of_144_ranks_inside_one_domain():
    """2 NVL72 domains, ranks handed out in random order (torchrun does not know the cliques)."""
    cliques = ["cluster-a.0"] * 72 + ["cluster-a.1"] * 72
    random.Random(16).shuffle(cliques)
    for ep, tp in ((72, 1), (36, 4), (8, 2), (24, 1)):
        order = rank_order(cliques, group=math.lcm(ep, tp))
        assert sorted(order) == list(range(144))  # a permutation: every rank once
        for size in (ep, tp):
            for start in range(0, 144, size):
                assert len({cliques[r] for r in order[start : start + size]}) == 1, (ep, tp, start)
    assert rank_order(cliques, 72) == rank_order(list(cliques), 72)  # every rank computes the same order


def test_rank_order_keeps_an_already_ordered_world_unchanged():
    assert rank_order(["a"] * 8 + ["b"] * 8, 8) == list(range(16))


def test_rank_order_refuses_a_domain_that_would_split_a_group():
    cliques = ["a"] * 70 + ["b"] * 74
    with pytest.raises(
        ValueError, match=r"NVLink domain 'a' holds 70 ranks, not a multiple of the EP/TP group size 72"
    ):
        rank_order(cliques, 72)


def test_plan_command_shows_placement_domain_memory_and_links(capsys, monkeypatch):
    from supernode.cli import main

    monkeypatch.setenv("COLUMNS", "240")
    assert main(["plan", "--stack", "gb200", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    plan = build_plan("gb200", load_stack("gb200", ROOT))
    assert "NVLink domain" in out and "u-p6e-gb200x72: 18 node(s)" in out
    assert f"{plan.topology.domain_hbm_gib:,.0f} GiB HBM in one address space" in out
    assert "inside a domain: ep 72, dp_shard 72; across EFA: dp_replicate 2 over 2 domains (EFA)" in out
    assert (
        f"all-to-all {plan.step.all_to_all_s:.3f} (NVLink)" in out
        and f"replicate {plan.step.replicate_s:.3f} (EFA)" in out
    )
    assert main(["plan", "--stack", "gb200", "--root", str(ROOT), "--json"]) == 0
    data = __import__("json").loads(capsys.readouterr().out)
    assert data["topology"]["domain_gpus"] == 72 and data["step"]["links"]["all_to_all"] == "NVLink"
