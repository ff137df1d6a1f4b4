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
