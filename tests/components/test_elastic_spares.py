"""Elastic training and spare nodes in the deployed objects (issue 26, items 2 and 3): prod's
PyTorchJob runs elastic between training.minNodes and the planned nodes, its node groups boot the
spare beside the world, and Kueue's training quota holds the spare but lends only what the elastic
job can give up. Read from the program's own resources under the mock engine."""

from __future__ import annotations

import pytest
from aws_preview import NODE_GROUP, preview

from supernode.core.plan import build_plan
from supernode.tools import manifests as mf

pytestmark = pytest.mark.slow  # runs the Pulumi program under the mock engine


def manifests(kind: str) -> list[dict]:
    return [m for m in mf.from_resources(preview("prod").result.resources) if m["kind"] == kind]


def test_prod_job_is_elastic_from_min_nodes_to_the_planned_nodes():
    [job] = manifests("PyTorchJob")
    spec = job["spec"]
    assert spec["elasticPolicy"]["minReplicas"] == 8 and spec["elasticPolicy"]["maxReplicas"] == 16
    # the job asks for the planned nodes, never the spare; torchrun's ranks per node are unchanged
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 16 and spec["nprocPerNode"] == "8"


def test_prod_node_groups_boot_the_spare_beside_the_world():
    stack = preview("prod")
    sizes = {
        g.name: stack.one(NODE_GROUP, g.name).inputs["scalingConfig"]["desiredSize"]
        for g in stack.cfg.accelerator_node_groups
    }
    # gpu-p5-a: 8 nodes + 1 spare; gpu-p5-b 8; serving 4 (2 replicas of two nodes)
    assert sizes == {"gpu-p5-a": 9, "gpu-p5-b": 8, "gpu-p5-serve": 4}
    scaling = stack.one(NODE_GROUP, "gpu-p5-a").inputs["scalingConfig"]
    assert scaling == {"minSize": 9, "desiredSize": 9, "maxSize": 9}


def _gpu_quotas(stack, names: set[str]) -> list[dict]:
    cqs = [m for m in mf.from_resources(stack.result.resources) if m["kind"] == "ClusterQueue"]
    return [
        next(r for r in cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"] if r["name"] == "nvidia.com/gpu")
        for cq in cqs
        if cq["metadata"]["name"] in names
    ]


def test_prod_training_quota_holds_the_spare_and_lends_only_what_the_job_gives_up():
    # prod as it was before its teams: training's one ClusterQueue holds its whole share
    stack = preview("prod", "no-teams", lambda d: (d.pop("teams"), d.pop("management")))
    [gpus] = _gpu_quotas(stack, {"gpu-h100"})
    # 17 training nodes x 8 = 136 GPUs of quota; lends (136 - 8 spare) - 8 x 8 minimum = 64
    assert int(gpus["nominalQuota"]) == 136 and gpus["lendingLimit"] == 64
    # with its teams the two teams' queues hold the same share, spare included, and lend no more together
    teams = _gpu_quotas(preview("prod"), {"gpu-h100-research", "gpu-h100-platform"})
    assert sum(int(g["nominalQuota"]) for g in teams) == 136 and sum(int(g["lendingLimit"]) for g in teams) == 64
    plan = build_plan("prod", stack.cfg)
    assert (plan.spare_nodes, plan.spare_accelerators) == (1, 8)
