"""One Layout and one estimate (issue 35 item 2; elastic layouts: issue 26 item 2): the layout of every
world from training.minNodes to the planned nodes (a local plan: every world 1..nproc), the global
batch kept by accumulation and zero-weight padding, and `Plan.for_world` selecting the world's layout
for the trainer."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from supernode.cli import main
from supernode.core import capacity as cap
from supernode.core.config import ConfigError, from_mapping, load_stack
from supernode.core.errors import BadInput
from supernode.core.estimate import derive, estimate, padded_training, rounds
from supernode.core.plan import Plan, build_local_plan, build_plan

ROOT = Path(__file__).resolve().parents[2]


def variant(name: str, change):
    data = copy.deepcopy(load_stack(name, ROOT).to_mapping())
    change(data)
    return from_mapping(data, f"{name} variant")


def set_min_nodes(n: int):
    def change(data: dict) -> None:
        data["training"]["minNodes"] = n

    return change


@pytest.fixture(scope="module")
def prod() -> Plan:
    return build_plan("prod", load_stack("prod", ROOT))


def test_prod_is_elastic_from_one_reservation_to_both(prod):
    # prod ships minNodes 8: one of its two 8-node capacity reservations keeps the job running.
    assert [(e.nodes, e.world_size) for e in prod.layouts] == [(n, 8 * n) for n in range(8, 17)]
    assert all(e.fits and e.reason is None for e in prod.layouts), [e.reason for e in prod.layouts]


def test_the_planned_world_is_the_plans_own_layout(prod):
    planned = prod.layouts[-1]
    assert prod.layout is planned  # held once: the plan's figures are its layout's
    assert planned.world_size == prod.world_size and planned.nodes == prod.nodes
    assert planned.parallel == prod.parallel and planned.degrees == prod.degrees
    assert planned.pipeline == prod.pipeline and planned.memory == prod.memory and planned.step == prod.step
    assert planned.micro_batches_per_step == prod.micro_batches_per_step and planned.padded_micro_batches == 0
    assert planned.memory_per_rank_gib == prod.memory_per_rank_gib and planned.fits == prod.fits
    assert planned.tokens_per_s == prod.training.global_batch * prod.model.seq_len / prod.step.step_s


def test_every_layout_follows_the_rule(prod):
    planned, t = prod.parallel, prod.training
    for e in prod.layouts:
        d = e.degrees
        assert d.world_size == e.world_size
        assert (d.tp, d.pp) == (planned.tp, planned.pp)
        assert planned.dp_replicate % d.dp_replicate == 0  # the planned replicas or a divisor of them
        # ep: inside its planned group, valid for the model and the replica, and the largest such
        assert d.ep <= planned.ep and prod.model.experts % d.ep == 0 and (d.dp_shard * d.tp) % d.ep == 0
        assert not any(
            (d.dp_shard * d.tp) % k == 0 and prod.model.experts % k == 0 for k in range(d.ep + 1, planned.ep + 1)
        )
        # the global batch is kept: every micro-batch of it has a slot, the padding is less than a round
        slots = e.micro_batches_per_step * d.dp
        assert slots - e.padded_micro_batches == t.global_batch // t.micro_batch
        assert 0 <= e.padded_micro_batches < d.dp
        # the options are the planned ones
        assert e.parallel.activation_checkpointing == planned.activation_checkpointing
        assert e.parallel.hbm_headroom == planned.hbm_headroom


def test_fifteen_nodes_pad_56_micro_batches_and_shrink_ep(prod):
    # global 1024, micro 1, dp 120: ceil(1024/120) = 9 rounds, 9*120 - 1024 = 56 padded slots.
    # Candidates: 2 replicas x 60 (ep: the divisors of 60 that divide 128 experts, at most 4) or one
    # replica x 120 (ep 8): the larger EP group gathers half the expert weights, so it is faster.
    e = next(e for e in prod.layouts if e.nodes == 15)
    assert (e.degrees.dp_replicate, e.degrees.dp_shard, e.degrees.ep) == (1, 120, 8)
    hw, pc = prod.hardware, prod.params
    domain = prod.topology.domain_gpus
    alt = estimate(prod.model, prod.parallel, prod.training, hw, pc, 15, 120, domain, replicas=[2])
    assert (alt.degrees.dp_replicate, alt.degrees.ep) == (2, 4) and alt.fits and alt.step_s > e.step_s
    assert (e.micro_batches_per_step, e.padded_micro_batches) == (9, 56)
    assert rounds(prod.training, 120) == 9 and padded_training(prod.training, 120).global_batch == 1080
    # the padded micro-batches cost time (costed on 1080 sequences), MFU counts the 1024 learnt from
    flops = 1024 * prod.model.seq_len * prod.flops_per_token / 120
    assert e.step.mfu == pytest.approx(flops / (e.step.step_s * prod.hardware.peak_flops))
    assert e.tokens_per_s == pytest.approx(1024 * prod.model.seq_len / e.step_s)


def test_fewer_ranks_hold_more_of_the_state(prod):
    by_nodes = {e.nodes: e for e in prod.layouts}
    assert by_nodes[8].memory.params_per_rank > by_nodes[16].memory.params_per_rank
    assert by_nodes[8].memory_per_rank_gib > by_nodes[16].memory_per_rank_gib
    assert by_nodes[8].micro_batches_per_step == 2 * by_nodes[16].micro_batches_per_step  # same global batch


def test_for_world_is_the_plan_at_that_world_and_round_trips(prod):
    assert prod.for_world(prod.world_size) is prod
    for e in prod.layouts[:-1]:
        q = prod.for_world(e.world_size)
        assert Plan.from_json(q.to_json()) == q
        assert (q.world_size, q.nodes, q.degrees, q.parallel) == (e.world_size, e.nodes, e.degrees, e.parallel)
        assert (q.micro_batches_per_step, q.padded_micro_batches) == (e.micro_batches_per_step, e.padded_micro_batches)
        assert (q.pipeline, q.memory, q.step, q.fits) == (e.pipeline, e.memory, e.step, True)
        assert q.training == prod.training  # the global batch is kept
        # the placement is the new layout's: its ep groups and the domains the job spans
        assert q.layout is e and q.layout.group("ep").size == e.degrees.ep
        assert q.layout.domains == e.world_size // prod.topology.domain_gpus
        assert q.summary()["world_size"] == e.world_size


# The figures that depend on the world are the selected layout's (properties); the fields describe the
# stack or every world at once (the layouts, the grace period their slowest step needs, the pools), the
# same whatever world a job runs at, except `world_size` (which layout) and the planned world's
# suggestions. A new Plan field must be put on one side.
PER_WORLD_FIELDS = {"world_size", "suggestions"}
PER_STACK = {
    "stack", "local", "device", "instance_type", "accelerators_per_node", "model", "training", "params", "flops_per_token",
    "hbm_gib", "usable_hbm_gib", "calibration", "topology", "checkpoint", "gate_floor_gbytes_s", "pod",
    "cost_per_hour_usd", "spare_nodes", "spare_accelerators", "spare_cost_per_hour_usd", "inference", "pools",
    "teams", "team", "termination_grace_s", "termination_grace_needed_s", "layouts",
}  # fmt: skip
FROM_THE_LAYOUT = (
    "nodes", "parallel", "degrees", "micro_batches_per_step", "padded_micro_batches", "pipeline", "memory",
    "memory_per_rank_gib", "fits", "over_by_gib", "step",
)  # fmt: skip


def test_a_plan_at_an_elastic_world_has_no_field_of_another_world(prod):
    """Issue 35: `for_world` copied 13 of the fields, so run_hours and the run's cost still described
    the planned world. Now the plan holds each world's layout once and `world_size` selects one: every
    world figure is that layout's, and the run's hours follow its step time."""
    assert set(Plan.model_fields) == PER_WORLD_FIELDS | PER_STACK and not PER_WORLD_FIELDS & PER_STACK
    assert not {"placement", "domains"} & set(type(prod.topology).model_fields)
    for e in prod.layouts[:-1]:
        if not e.fits:
            continue
        q = prod.for_world(e.world_size)
        assert all(getattr(q, f) == getattr(prod, f) for f in PER_STACK)
        assert all(getattr(q, f) == getattr(e, f) for f in FROM_THE_LAYOUT), [
            f for f in FROM_THE_LAYOUT if getattr(q, f) != getattr(e, f)
        ]
        assert q.run_hours == pytest.approx(prod.training.steps * e.step.step_s / 3600)
        assert q.run_cost_usd == pytest.approx(q.cost_per_hour_usd * q.run_hours)
        assert q.run_hours > prod.run_hours  # fewer ranks, the same global batch: a longer run
        assert q.suggestions == []


def test_a_plan_file_without_a_costed_layout_for_its_world_is_refused(prod):
    doc = json.loads(prod.to_json())
    doc["world_size"] = 60
    with pytest.raises(ValueError, match="world_size 60: needs exactly one costed layout"):
        Plan.model_validate(doc)


def test_a_world_outside_the_range_is_bad_input_naming_it(prod):
    with pytest.raises(BadInput, match=r"world size 60: the plan has no elastic layout for it .*64, 72"):
        prod.for_world(60)


def test_a_world_that_does_not_fit_is_listed_with_the_reason_and_refused():
    plan = build_plan("prod", variant("prod", set_min_nodes(1)))
    one = plan.layouts[0]
    assert (one.nodes, one.world_size, one.fits) == (1, 8, False)
    usable = cap.usable_hbm_bytes(one.parallel, plan.hardware) / 2**30
    assert one.memory_per_rank_gib > usable
    assert one.reason == f"{one.memory_per_rank_gib:.1f} GiB per rank > the usable {usable:.1f} GiB of 80 GiB HBM"
    with pytest.raises(BadInput, match=r"world size 8: no layout runs there \(the plan's worlds 8\.\.128 ranks\)"):
        plan.for_world(8)


def test_a_world_tp_does_not_divide_has_no_layout():
    def tp2_on_four(data: dict) -> None:
        data["local"]["nproc"] = 4
        data["local"]["parallel"] = {"dpShard": 2, "tp": 2, "ep": 2}
        data["local"]["model"]["kvHeads"] = 2  # tp 2 divides the heads

    plan = build_local_plan("dev", variant("dev", tp2_on_four))
    assert [(e.world_size, e.fits) for e in plan.layouts] == [(1, False), (2, True), (3, False), (4, True)]
    assert plan.layouts[2].reason == "tp*pp = 2*1 = 2 does not divide the world 3"
    assert plan.layouts[2].parallel is None
    with pytest.raises(BadInput, match="world size 3: no layout runs there .* does not divide the world 3"):
        plan.for_world(3)
    assert derive(plan.parallel, 2, plan.model.experts).dp_shard == 1


def test_a_local_plan_covers_every_world_up_to_nproc():
    cfg = load_stack("dev", ROOT)
    plan = build_local_plan("dev", cfg, nproc=4)  # local: globalBatch 16, microBatch 4, ep 2
    assert [e.world_size for e in plan.layouts] == [1, 2, 3, 4] and all(e.fits for e in plan.layouts)
    three = plan.layouts[2]
    # 16/4 = 4 micro-batches over dp 3: 2 rounds, 2 padded slots; ep 2 does not divide dp_shard 3: ep 1
    assert (three.degrees.dp_shard, three.degrees.ep) == (3, 1)
    assert (three.micro_batches_per_step, three.padded_micro_batches) == (2, 2)
    q = plan.for_world(3)
    assert Plan.from_json(q.to_json()) == q and q.local and q.nodes == 3  # one rank per "node"
    with pytest.raises(BadInput, match="world size 5: the plan has no elastic layout .*at most local.nproc"):
        plan.for_world(5)


def test_without_min_nodes_the_job_is_not_elastic():
    plan = build_plan("dev", load_stack("dev", ROOT))
    assert load_stack("dev", ROOT).training.min_nodes is None
    assert [e.world_size for e in plan.layouts] == [plan.world_size]
    dev1 = build_plan("dev", variant("dev", set_min_nodes(1)))
    assert [(e.nodes, e.world_size, e.fits) for e in dev1.layouts] == [(1, 8, True), (2, 16, True)]


def test_min_nodes_above_the_training_nodes_is_a_config_error_naming_it():
    data = copy.deepcopy(load_stack("dev", ROOT).to_mapping())
    data["training"]["minNodes"] = 3
    with pytest.raises(ConfigError) as e:
        from_mapping(data)
    [issue] = e.value.issues
    assert issue.path == "supernode:training.minNodes" and issue.value == 3
    assert "at most the training nodes (2" in issue.message
    data["training"]["minNodes"] = 0
    with pytest.raises(ConfigError) as e:
        from_mapping(data)
    assert [i.path for i in e.value.issues] == ["supernode:training.minNodes"]


def test_local_has_no_min_nodes_of_its_own():
    data = copy.deepcopy(load_stack("dev", ROOT).to_mapping())
    data["local"]["training"]["minNodes"] = 1
    with pytest.raises(ConfigError) as e:
        from_mapping(data)
    assert [i.path for i in e.value.issues] == ["supernode:local.training.minNodes"]


def test_min_nodes_too_large_exits_2_with_one_line(tmp_path, capsys):
    text = (ROOT / "Pulumi.prod.yaml").read_text().replace("minNodes: 8", "minNodes: 17")
    (tmp_path / "Pulumi.big.yaml").write_text(text)
    assert main(["plan", "--config", str(tmp_path / "Pulumi.big.yaml")]) == 2
    err = capsys.readouterr().err
    assert "supernode:training.minNodes: must be at most the training nodes (16" in err and "(got 17)" in err
    assert "Traceback" not in err


def test_plan_prints_and_serialises_the_elastic_layouts(capsys):
    assert main(["plan", "--stack", "prod", "--root", str(ROOT)]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "elastic 15 nodes world 120 dp_replicate 1 x dp_shard 120 x tp 1 x pp 1; ep 8;" in text
    assert "9 micro-batches per step (+56 padded)" in text
    # ep 8 at 15 nodes gathers twice the experts per micro-batch that ep 16 at 14 does
    assert "(1.59x the step); slower than on 14 nodes" in text
    assert (
        "elastic 12 nodes" in text and "slower than on" not in text.split("elastic 12 nodes")[1].split("elastic 13")[0]
    )
    assert main(["plan", "--stack", "prod", "--root", str(ROOT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [e["world_size"] for e in out["layouts"]] == list(range(64, 129, 8))
    assert math.isclose(out["layouts"][-1]["step_s"], out["step"]["step_s"])


# -- pools with an elastic minimum and spare nodes (items 2 and 3) ----------------------------------


def test_prod_pool_counts_the_spare_and_lends_what_the_elastic_job_gives_up(prod):
    [pool] = prod.pools
    # 16 training + 1 spare + 4 serving p5 nodes of 8 H100 (two replicas of 16 GPUs)
    assert (pool.devices, pool.training_devices, pool.spare_devices, pool.serving_devices) == (168, 136, 8, 32)
    assert (pool.training_min, pool.training_max) == (64, 128)  # minNodes 8 to 16 nodes
    assert pool.training_lending_limit == 136 - 8 - 64 == 64  # never the spare
    assert pool.adds_up and "pool H100: 168 GPUs (16 training + 1 spare + 4 serving nodes)" in pool.reason
    assert "training min 64 + serving min 32 = 96 <= 168; training lends 128 - 64 = 64" in pool.reason


def test_more_spares_are_never_lent():
    def three_spares(data: dict) -> None:
        data["acceleratorNodeGroups"][0]["spares"] = 3

    [pool] = build_plan("prod", variant("prod", three_spares)).pools
    assert (pool.devices, pool.spare_devices, pool.training_max) == (184, 24, 128)
    assert pool.training_lending_limit == 64


def test_serving_beyond_its_share_borrows_what_training_lends():
    cfg = variant("prod", lambda d: d["inference"].update(replicasMax=6))
    [pool] = build_plan("prod", cfg).pools
    # serving max 6 x 16 = 96, its share 32: it borrows the 64 training lends, so no replica waits
    assert (pool.serving_borrowing_limit, pool.serving_reachable_max) == (64, 96)
    assert "reachable 96" in pool.reason and "wait" not in pool.reason


def test_an_elastic_minimum_does_not_let_serving_start_on_training_nodes():
    def serving_on_training_nodes(data: dict) -> None:
        data["acceleratorNodeGroups"] = [g for g in data["acceleratorNodeGroups"] if g["role"] != "serving"]
        data["training"]["minNodes"] = 1

    [pool] = build_plan("dev", variant("dev", serving_on_training_nodes)).pools
    # training min 8 + serving min 1 fits 16, but serving's minimum would still need training's devices
    assert not pool.adds_up and pool.training_min == 8 and pool.training_lending_limit == 8
    assert "serving min 1 x 1 = 1 > serving's reserved share 0" in pool.reason


def test_the_cost_counts_the_spare():
    cfg = load_stack("prod", ROOT)
    plan = build_plan("prod", cfg)
    price = plan.hardware.price_per_hour
    assert plan.cost_per_hour_usd == pytest.approx((16 + 1 + 4) * price)
    assert plan.spare_cost_per_hour_usd == pytest.approx(price) and plan.spare_nodes == 1
    assert plan.run_cost_usd == pytest.approx(plan.cost_per_hour_usd * plan.run_hours)
    # the spare is outside the world: layout and elastic range as without it
    without = build_plan("prod", variant("prod", lambda d: d["acceleratorNodeGroups"][0].pop("spares")))
    assert (without.world_size, without.layouts) == (plan.world_size, plan.layouts)
    assert plan.cost_per_hour_usd - without.cost_per_hour_usd == pytest.approx(price)


@pytest.mark.parametrize(
    ("stack", "group", "why"),
    [
        ("prod", 2, "only a role: training group has them"),  # gpu-p5-serve
        ("gb200", 0, "a group with ultraServer is exactly one u-p6e-gb200x72"),
    ],
)
def test_spares_only_on_plain_training_groups(stack, group, why):
    data = copy.deepcopy(load_stack(stack, ROOT).to_mapping())
    data["acceleratorNodeGroups"][group]["spares"] = 1
    with pytest.raises(ConfigError) as e:
        from_mapping(data)
    [issue] = e.value.issues
    assert issue.path == f"supernode:acceleratorNodeGroups[{group}].spares" and issue.value == 1
    assert why in issue.message


def test_plan_prints_the_spare_cost(capsys):
    assert main(["plan", "--stack", "prod", "--root", str(ROOT)]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "cost $1,155.84/h" in text and "of it 1 spare node(s) $55.04/h" in text
    assert "lends 64, never its 8 spare GPUs" in text


def test_a_world_whose_rounds_break_the_pipeline_schedule_has_no_layout():
    def interleaved_on_three_nodes(data: dict) -> None:
        data["acceleratorNodeGroups"][0]["nodes"] = 3
        data["parallel"].update(dpShard=6, tp=2, pp=2, ep=4, ppSchedule="interleaved1f1b", ppVirtualStages=2)
        data["training"].update(globalBatch=60, microBatch=1, minNodes=2)

    plan = build_plan("dev", variant("dev", interleaved_on_three_nodes))
    two, three = plan.layouts
    # 3 nodes: dp 6, 10 rounds; 2 nodes: dp 4, ceil(60/4) = 15 rounds, not a multiple of pp 2
    assert (three.fits, three.micro_batches_per_step) == (True, 10)
    assert not two.fits and two.degrees.dp == 4 and two.memory is None
    assert "interleaved1f1b needs the micro-batches per step" in two.reason and "= 15)" in two.reason


def test_plan_fails_when_a_node_count_of_the_elastic_range_does_not_fit(tmp_path, capsys):
    text = (ROOT / "Pulumi.prod.yaml").read_text().replace("minNodes: 8", "minNodes: 3")
    (tmp_path / "Pulumi.three.yaml").write_text(text)
    assert main(["plan", "--config", str(tmp_path / "Pulumi.three.yaml")]) == 1  # as memory-fit-elastic
    out = " ".join(capsys.readouterr().out.split())
    assert "The elastic job may run on 3 nodes (training.minNodes 3) but has no layout there: 142.8 GiB per rank" in out
