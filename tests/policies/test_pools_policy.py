"""Issue 26, items 1 and 5, through the real program and the pack: the shipped stacks' pools add up
and their trainer pods' grace periods cover a checkpoint; stacks that break either fail with the
numbers and the key to change."""

from __future__ import annotations

import copy

import pytest
from policy_resources import ROOT, built_images

from supernode.core import resource_types as T
from supernode.core.catalog import CATALOG
from supernode.core.config import from_mapping, load_stack
from supernode.core.plan import build_plan
from supernode.tools.policycheck import check, config_from_stack
from supernode.tools.preview import run_program

pytestmark = pytest.mark.slow  # runs the Pulumi program under the mock engine (seconds per stack)

POOLS, GRACE = "accelerators-pools-add-up", "checkpoint-termination-grace"


def findings(name: str, cfg) -> tuple[dict[str, list[str]], list[str]]:
    """The stack's mandatory findings by policy, and the policies that ran on it."""
    resources = [r.to_json() for r in run_program(name, cfg).resources]
    report = check(resources, config_from_stack(cfg))
    out: dict[str, list[str]] = {}
    for v in report.mandatory:
        out.setdefault(v.policy, []).append(v.message)
    return out, report.policies


def variant(name: str, change) -> object:
    data = copy.deepcopy(load_stack(name, ROOT).to_mapping())
    change(data)
    return from_mapping(data, f"{name} variant")


@pytest.mark.parametrize("name", ["dev", "prod", "gb200", "b300"])
def test_the_shipped_stacks_pools_add_up_and_their_grace_covers_a_checkpoint(name):
    cfg = load_stack(name, ROOT)
    if name == "prod":
        cfg = built_images(cfg)  # prod's placeholder images fail their own policies on purpose
    found, ran = findings(name, cfg)
    assert {POOLS, GRACE} <= set(ran)
    assert POOLS not in found and GRACE not in found, found
    plan = build_plan(name, cfg)
    for pool in plan.pools:
        assert pool.adds_up, pool.reason
        assert pool.training_min + pool.serving_min <= pool.devices
        assert pool.serving_reachable_max == pool.serving_max  # no shipped replica waits for lent quota
    assert plan.termination_grace_s >= plan.termination_grace_needed_s


def test_dev_without_its_serving_group_fails_with_the_numbers():
    """Serving on the training nodes: serving's first replica would evict the job for good."""
    cfg = variant(
        "dev",
        lambda d: d.update(acceleratorNodeGroups=[g for g in d["acceleratorNodeGroups"] if g["role"] != "serving"]),
    )
    found, _ = findings("dev", cfg)
    per_node = CATALOG[cfg.accelerator_node_groups[0].instance_type].accelerators
    world, pool = cfg.accelerators, cfg.nodes * per_node
    serving_min = cfg.inference.replicas_min * cfg.inference.tp * cfg.inference.pp
    [message] = found[POOLS]
    assert f"pool H100: {pool} GPUs ({cfg.nodes} training + 0 serving nodes)" in message
    assert f"training min {world} + serving min {serving_min} = {world + serving_min} > {pool}" in message
    assert "role: serving" in message and "Fix:" in message
    assert set(found) == {POOLS}, found  # nothing else in the stack is wrong


def test_prod_serving_more_than_its_share_fails_with_the_numbers():
    cfg = built_images(variant("prod", lambda d: d["inference"].update(replicasMin=3, replicasMax=3)))
    found, _ = findings("prod", cfg)
    [message] = found[POOLS]
    # 16 training nodes (+ 1 spare) and 4 serving nodes of 8 H100; serving 3 replicas x 16 GPUs. Training's
    # elastic minimum (8 nodes: 64) + 48 fits the pool, but serving's minimum does not fit its own share.
    assert "pool H100: 168 GPUs (16 training + 1 spare + 4 serving nodes); serving min 3 x 16" in message
    assert "serving min 3 x 16 = 48 > serving's reserved share 32 (4 serving nodes)" in message


def test_a_serving_group_the_plan_did_not_count_is_named():
    """The preview's node groups against the plan's pool: a serving group of another size than planned."""
    cfg = load_stack("dev", ROOT)
    resources = [r.to_json() for r in run_program("dev", cfg).resources]
    [serving] = [
        r
        for r in resources
        if r["type"] == T.NODE_GROUP and r["inputs"].get("labels", {}).get("supernode.io/gpu-role") == "serving"
    ]
    serving["inputs"]["scalingConfig"]["desiredSize"] = 2
    found = {v.policy: v.message for v in check(resources, config_from_stack(cfg)).mandatory}
    assert "the serving node groups give 16 GPUs, but the plan" in found[POOLS]
    assert "counted 8 for serving's share" in found[POOLS]


def test_a_grace_period_below_the_checkpoint_write_fails_naming_the_key_and_both_numbers():
    cfg = variant("dev", lambda d: d["workload"].update(terminationGraceS=40))
    plan = build_plan("dev", cfg)
    assert plan.termination_grace_needed_s > 40  # one step + one checkpoint write + the margin
    found, _ = findings("dev", cfg)
    [message] = found[GRACE]
    assert "terminationGracePeriodSeconds 40 s" in message
    assert f"Fix: supernode:workload.terminationGraceS >= {plan.termination_grace_needed_s}" in message
    assert f"writing a checkpoint ({plan.checkpoint.write_seconds:.0f} s)" in message


# -- teams (issue 36, item 4): the teams' quotas add up to training's share ----------------------------


def test_prods_teams_quotas_that_leave_the_spare_to_no_team_fail_with_the_numbers():
    """platform 32 instead of 40: 96 + 32 = 128 of training's 136 (16 nodes + the spare), 8 GPUs no team owns."""
    cfg = built_images(variant("prod", lambda d: d["teams"][1].update(nominalQuota=32)))
    found, _ = findings("prod", cfg)
    # the plan's verdict, and the deployed queues (the plan's quotas as written) against training's share
    message, deployed = found[POOLS]
    assert "gpu-h100-platform 32 = 128 GPUs" in deployed and "less than the nodes, some idle" in deployed
    assert "teams in pool H100: research 96 + platform 32 = 128" in message
    assert "!= training's share 136 GPUs" in message
    assert "Fix: set supernode:teams[].nominalQuota to add up to 136 GPUs" in message
    assert set(found) == {POOLS}, found  # nothing else in the stack is wrong


def test_deployed_team_queues_that_do_not_hold_the_plans_quotas_are_named():
    """The plan adds up, but a team's ClusterQueue in the stack holds another quota: the pack reads the
    queues themselves, so the cohort cannot admit more than the nodes behind the plan's back."""
    cfg = built_images(load_stack("prod", ROOT))
    resources = [r.to_json() for r in run_program("prod", cfg).resources]
    assert POOLS not in {v.policy for v in check(resources, config_from_stack(cfg)).mandatory}
    [cq] = [
        r for r in resources if r["type"] == T.CLUSTER_QUEUE and r["inputs"]["metadata"]["name"] == "gpu-h100-platform"
    ]
    for r in cq["inputs"]["spec"]["resourceGroups"][0]["flavors"][0]["resources"]:
        if r["name"] == "nvidia.com/gpu":
            r["nominalQuota"] = "48"
    [message] = [v.message for v in check(resources, config_from_stack(cfg)).mandatory if v.policy == POOLS]
    assert "the teams' ClusterQueues hold gpu-h100-research 96 + gpu-h100-platform 48 = 144 GPUs" in message
    assert "the cohort would admit more than the nodes" in message
    # a team queue missing altogether is named too (and the deployed quotas then fall short)
    resources = [r for r in resources if r is not cq]
    found = [v.message for v in check(resources, config_from_stack(cfg)).mandatory if v.policy == POOLS]
    assert any("no ClusterQueue gpu-h100-platform is deployed" in m for m in found), found
    assert any("gpu-h100-research 96 = 96 GPUs" in m and "less than the nodes" in m for m in found), found


def test_an_access_entry_to_a_system_group_is_refused():
    cfg = built_images(load_stack("prod", ROOT))
    resources = [r.to_json() for r in run_program("prod", cfg).resources]
    entries = [r for r in resources if r["type"] == T.ACCESS_ENTRY]
    assert len(entries) == 2
    assert "eks-access-entries" not in {v.policy for v in check(resources, config_from_stack(cfg)).mandatory}
    entries[0]["inputs"]["kubernetesGroups"] = ["system:masters"]
    found = [v.message for v in check(resources, config_from_stack(cfg)).mandatory if v.policy == "eks-access-entries"]
    assert len(found) == 1 and "['system:masters']" in found[0] and "supernode:team:<name>" in found[0]


# -- right-sized pools (issue 38, item 5): a stack that strands GPUs fails, naming how many --------------


def test_a_serving_node_its_maximum_cannot_fill_fails_naming_the_stranded_gpus():
    """dev as it shipped before: one p5 (8 H100) for serving's 2 replicas x tp 1. The minimums fit, but 6
    GPUs can never be used: no replica beyond 2, and less than the whole node a training pod needs."""
    cfg = variant("dev", lambda d: d["inference"].update(replicasMax=2))
    found, _ = findings("dev", cfg)
    [message] = found[POOLS]
    assert "pool H100: 6 GPUs unreachable: 6 of serving's share 8 (1 serving nodes of 8)" in message
    assert "serving max 2 x 1 = 2" in message and "supernode:inference.replicasMax 8" in message
    assert "Fix: size the serving node groups by serving's maximum replicas" in message
    assert "serving's first replica evicts" not in message  # the minimums fit: not the other finding
    assert set(found) == {POOLS}, found  # nothing else in the stack is wrong
