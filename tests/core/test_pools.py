"""The pool arithmetic in the core (issue 26, item 1) and the trainer's grace period from the plan
(item 5): the figures the Kueue quotas and the policies read, and `supernode plan` printing them."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from supernode.cli import main
from supernode.core.catalog import CATALOG
from supernode.core.config import from_mapping, load_stack
from supernode.core.plan import build_local_plan, build_plan
from supernode.core.pools import GRACE_MARGIN_S, termination_grace_needed_s

ROOT = Path(__file__).resolve().parents[2]


def variant(name: str, change):
    data = copy.deepcopy(load_stack(name, ROOT).to_mapping())
    change(data)
    return from_mapping(data, f"{name} variant")


def without_serving_groups(data: dict) -> None:
    data["acceleratorNodeGroups"] = [g for g in data["acceleratorNodeGroups"] if g["role"] != "serving"]


@pytest.mark.parametrize("name", ["dev", "prod", "gb200", "b300", "trn2"])
def test_the_shipped_stacks_pools_add_up(name):
    cfg = load_stack(name, ROOT)
    plan = build_plan(name, cfg)
    [pool] = plan.pools
    hw = plan.hardware
    assert pool.devices == sum(g.nodes + g.spares for g in cfg.accelerator_node_groups) * hw.chips
    # training: max = the plan's world in devices (a Trainium device is several ranks), min = its world at
    # training.minNodes; the spares are in training's share, outside the world
    spares = sum(g.spares for g in cfg.training_node_groups) * hw.chips
    assert pool.training_max == plan.world_size // hw.ranks_per_chip == pool.training_devices - spares
    assert pool.spare_devices == spares
    assert pool.training_min == (cfg.training.min_nodes or cfg.nodes) * hw.chips
    assert pool.training_min + pool.serving_min <= pool.devices and pool.adds_up, pool.reason
    assert f"<= {pool.devices}" in pool.reason


@pytest.mark.parametrize("name", ["dev", "prod"])
def test_serving_is_replicas_x_tp_x_pp_on_its_own_share(name):
    cfg = load_stack(name, ROOT)
    plan = build_plan(name, cfg)
    [pool] = plan.pools
    inf = cfg.inference
    per_replica = inf.tp * inf.pp
    assert (pool.serving_min, pool.serving_max) == (inf.replicas_min * per_replica, inf.replicas_max * per_replica)
    serving_nodes = sum(g.nodes for g in cfg.accelerator_node_groups if g.role == "serving")
    assert pool.serving_devices == serving_nodes * CATALOG[plan.instance_type].accelerators
    assert pool.serving_min <= pool.serving_max <= pool.serving_devices
    # serving's groups are outside the training world: the layout and the trainer pods count training's only
    assert plan.nodes == sum(g.nodes for g in cfg.accelerator_node_groups if g.role == "training")
    assert plan.world_size == pool.training_devices - pool.spare_devices
    # training lends what the elastic job can give up (dev is not elastic: nothing; prod: 16 - 8 nodes),
    # never a spare; serving reaches its maximum on its own share, so it borrows none of it
    assert pool.training_lending_limit == {"dev": 0, "prod": 64}[name]
    assert pool.serving_borrowing_limit == 0
    assert pool.serving_reachable_max == pool.serving_max


def test_serving_on_the_training_nodes_does_not_add_up():
    cfg = variant("dev", without_serving_groups)
    [pool] = build_plan("dev", cfg).pools
    assert not pool.adds_up
    assert pool.reason == (
        "pool H100: 16 GPUs (2 training + 0 serving nodes); training min 16 + serving min 1 = 17 > 16; serving min 1 x 1 = 1 > "
        "serving's reserved share 0 (0 serving nodes): serving's minimum would need training's devices"
    )


def test_a_serving_share_below_replicas_max_says_which_replicas_wait():
    def not_elastic_serving_6(d: dict) -> None:  # a job that is not elastic lends nothing
        d["inference"].update(replicasMax=6)
        d["training"].pop("minNodes")

    cfg = variant("prod", not_elastic_serving_6)
    [pool] = build_plan("prod", cfg).pools
    assert pool.adds_up and pool.serving_max == 96 and pool.serving_reachable_max == 32
    assert "serving max 6 x 16 = 96, reachable 32 (its share 32 + lent 0: replicas above 2 wait)" in pool.reason


def test_a_stack_without_inference_has_no_serving_share():
    [pool] = build_plan("b300", load_stack("b300", ROOT)).pools
    assert (pool.serving_min, pool.serving_max, pool.serving_devices) == (0, 0, 0)
    assert build_local_plan("dev", load_stack("dev", ROOT)).pools == []  # a CPU run has no pool


def test_the_grace_period_needed_is_a_step_a_checkpoint_write_and_the_margin():
    assert termination_grace_needed_s(0.1, 37.7) == 38 + GRACE_MARGIN_S
    assert termination_grace_needed_s(9.7, 252.4) == 263 + GRACE_MARGIN_S
    plan = build_plan("prod", load_stack("prod", ROOT))
    # prod is elastic from 8 nodes: its slowest step (9 nodes, 28 s) is the one a preempted pod may be in
    slowest = max(e.step_s for e in plan.layouts)
    assert slowest > 2 * plan.step.step_s
    assert plan.termination_grace_needed_s == math.ceil(slowest + plan.checkpoint.write_seconds) + 30
    assert plan.termination_grace_s == load_stack("prod", ROOT).workload.termination_grace_s
    gb200 = build_plan("gb200", load_stack("gb200", ROOT))  # not elastic: its one step
    assert gb200.termination_grace_needed_s == math.ceil(gb200.step.step_s + gb200.checkpoint.write_seconds) + 30


def test_plan_prints_the_pool_arithmetic_and_the_grace_period(capsys):
    assert main(["plan", "--stack", "dev", "--root", str(ROOT)]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the table's borders and wrapping
    assert "pool H100 24 GPUs" in text
    assert "training min 16 + serving min 1 = 17 <= 24" in text
    assert "grace period 900 s" in text
    assert main(["plan", "--stack", "prod", "--root", str(ROOT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    [pool] = out["pools"]
    # 16 training + 1 spare + 4 serving p5; training elastic down to minNodes 8; serving 2 replicas x 16
    assert (pool["devices"], pool["training_min"], pool["serving_min"], pool["adds_up"]) == (168, 64, 32, True)
    assert (pool["stranded"], pool["training_borrowing_limit"]) == (0, 0)
    assert out["termination_grace_needed_s"] <= out["termination_grace_s"]


def test_a_stack_whose_groups_all_serve_is_refused_naming_the_key(tmp_path, capsys):
    text = (ROOT / "Pulumi.dev.yaml").read_text().replace("      nodes: 2\n", "      nodes: 2\n      role: serving\n")
    (tmp_path / "Pulumi.allserve.yaml").write_text(text)
    assert main(["plan", "--config", str(tmp_path / "Pulumi.allserve.yaml")]) == 2
    err = capsys.readouterr().err
    assert "supernode:acceleratorNodeGroups[].role: no group has role: training" in err
    assert "Traceback" not in err


# -- right-sized pools (issue 38, item 5): no shipped stack strands a GPU --------------------------------

# The arithmetic per shipped stack: (training nodes incl. spares, serving nodes), (training's share, spares,
# serving's share) in GPUs, serving's max and the most it reaches, what training lends and serving lends.
SHIPPED = {
    "dev": ((2, 1), (16, 0, 8), (8, 8), (0, 7)),
    "prod": ((17, 4), (136, 8, 32), (32, 32), (64, 0)),
    "gb200": ((36, 0), (144, 0, 0), (0, 0), (0, 0)),
    "b300": ((4, 0), (32, 0, 0), (0, 0), (0, 0)),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_no_shipped_stack_strands_a_gpu(name):
    [pool] = build_plan(name, load_stack(name, ROOT)).pools
    nodes, shares, serving, lends = SHIPPED[name]
    assert (pool.training_nodes, pool.serving_nodes) == nodes
    assert (pool.training_devices, pool.spare_devices, pool.serving_devices) == shares
    assert (pool.serving_max, pool.serving_reachable_max) == serving
    assert (pool.training_lending_limit, pool.serving_lending_limit) == lends
    assert pool.training_borrowing_limit == pool.serving_lending_limit  # what serving lends, training may borrow
    assert pool.stranded == 0 and pool.stranded_reason == "" and pool.adds_up, pool.reason
    assert f"every one of the {pool.devices} GPUs reachable" in pool.reason


def test_a_serving_node_its_maximum_cannot_fill_strands_its_gpus_naming_how_many():
    """dev as it shipped before issue 38: one p5 (8 H100) for 2 replicas x tp 1; the other 6 are less
    than a whole node, so no training pod can borrow them either."""
    [pool] = build_plan("dev", variant("dev", lambda d: d["inference"].update(replicasMax=2))).pools
    assert pool.fits and not pool.adds_up and pool.stranded == 6
    assert pool.stranded_reason == (
        "6 GPUs unreachable: 6 of serving's share 8 (1 serving nodes of 8): serving max 2 x 1 = 2, and what is "
        "left is less than a whole node training could borrow (size it: supernode:inference.replicasMax 8)"
    )
    assert pool.stranded_reason in pool.reason


def test_a_whole_idle_serving_node_is_training_s_to_borrow_not_stranded():
    """A second serving node beyond serving's maximum: a training pod (a whole node) may borrow it,
    preemptibly; with a maximum of 12, its last 4 GPUs are less than a node and stranded."""

    def serving_nodes(n: int, replicas_max: int):
        def change(d: dict) -> None:
            [g for g in d["acceleratorNodeGroups"] if g["role"] == "serving"][0]["nodes"] = n
            d["inference"].update(replicasMax=replicas_max)

        return variant("dev", change)

    [pool] = build_plan("dev", serving_nodes(2, 8)).pools
    assert (pool.serving_devices, pool.serving_max, pool.stranded) == (16, 8, 0) and pool.adds_up
    assert pool.training_borrowing_limit == 16 - 1  # serving's share less its minimum replica
    [pool] = build_plan("dev", serving_nodes(2, 12)).pools
    assert pool.stranded == 4 and "(size it: supernode:inference.replicasMax 16)" in pool.reason
    [pool] = build_plan("dev", serving_nodes(3, 2)).pools  # two whole nodes training may borrow, 6 stranded
    assert pool.stranded == 6 and "(size it: 1 serving nodes or supernode:inference.replicasMax 24)" in pool.reason


def test_serving_borrows_what_elastic_training_lends_beyond_its_share():
    """prod with 3 replicas of 16: 48 > serving's 32, and the elastic job lends 64 (16 - 8 nodes)."""
    [pool] = build_plan("prod", variant("prod", lambda d: d["inference"].update(replicasMax=3))).pools
    assert (pool.serving_max, pool.serving_borrowing_limit, pool.serving_reachable_max) == (48, 16, 48)
    assert pool.stranded == 0 and pool.adds_up, pool.reason
