"""Kueue (issue 18, item 3): a ClusterQueue per GPU pool whose quota is the node groups' hardware,
LocalQueues for the served namespaces, priorities, the trainer admitted through its queue, and every
object valid against the shipped (closed) CRD schemas."""

from __future__ import annotations

import copy

import pytest
from aws_preview import ROOT, preview

from supernode.components.k8s import queues as q
from supernode.components.k8s.common import pod_resources
from supernode.core import resource_types as T
from supernode.core.catalog import CATALOG
from supernode.core.config import load_stack
from supernode.core.plan import build_plan
from supernode.tools import manifests as mf


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_one_pool_per_accelerator_with_the_node_groups_quota(stack):
    cfg = load_stack(stack, ROOT)
    plan = build_plan(stack, cfg)
    [pool] = q.gpu_pools(cfg.accelerator_node_groups, plan)  # prod's two p5 groups are one H100 pool
    assert pool.nodes == sum(g.nodes for g in cfg.accelerator_node_groups) == plan.nodes
    hw = CATALOG[plan.instance_type]
    quota = pool.quota()
    assert quota["nvidia.com/gpu"] == str(plan.nodes * hw.accelerators)
    assert quota["vpc.amazonaws.com/efa"] == str(plan.nodes * hw.efa_interfaces)
    # The trainer's pods ask for nothing the queue does not cover, and the quota is exactly all of them:
    # the job is admitted whole or not at all.
    requests = pod_resources(plan.pod)["requests"]
    spec = q.cluster_queue_spec(pool, [cfg.workload.namespace])
    assert set(requests) == set(spec["resourceGroups"][0]["coveredResources"])
    for resource, amount in requests.items():
        per_pod = int(amount.removesuffix("Gi"))
        assert quota[resource] == (f"{plan.nodes * per_pod}Gi" if amount.endswith("Gi") else str(plan.nodes * per_pod))


def test_priorities_order_serving_training_experiments():
    v = {name: value for name, (value, _) in q.PRIORITIES.items()}
    assert v[q.SERVING] > v[q.TRAINING] > v[q.EXPERIMENTS]
    pool = q.Pool("h100", 2, build_plan("dev", load_stack("dev", ROOT)).pod)
    pre = q.cluster_queue_spec(pool, ["training"])["preemption"]
    # borrowed quota is reclaimed only from experiments, never from training or serving
    assert pre["borrowWithinCohort"]["maxPriorityThreshold"] == v[q.EXPERIMENTS]


@pytest.mark.slow
def test_kueue_objects_in_the_preview_are_wired_and_valid():
    stack = preview("dev")
    manifests = mf.from_resources(stack.result.resources)
    kinds = {}
    for m in manifests:
        kinds.setdefault(m["kind"], []).append(m)
    assert len(kinds["WorkloadPriorityClass"]) == 3 and len(kinds["ResourceFlavor"]) == 1
    [cq] = kinds["ClusterQueue"]
    [job] = [r.inputs for r in stack.all(T.PYTORCH_JOB)]
    labels = job["metadata"]["labels"]
    ns = stack.cfg.workload.namespace
    # one LocalQueue per served namespace (training; serving where the stack serves), all on the pool
    served = {m["metadata"]["namespace"] for m in kinds["LocalQueue"]}
    assert ns in served and served == set(cq["spec"]["namespaceSelector"]["matchExpressions"][0]["values"])
    [lq] = [m for m in kinds["LocalQueue"] if m["metadata"]["namespace"] == ns]
    # the trainer names a LocalQueue of its namespace, which feeds a ClusterQueue serving that namespace
    assert (lq["metadata"]["namespace"], lq["metadata"]["name"]) == (ns, labels[q.QUEUE_LABEL])
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert ns in cq["spec"]["namespaceSelector"]["matchExpressions"][0]["values"]
    assert labels[q.PRIORITY_LABEL] == q.TRAINING in {p["metadata"]["name"] for p in kinds["WorkloadPriorityClass"]}
    # the scheduled fabric check queues at the lowest priority: it waits for free nodes, never preempts training
    [cron] = [m for m in kinds["CronJob"] if "fabric" in m["metadata"]["name"]]
    assert cron["spec"]["jobTemplate"]["metadata"]["labels"] == {
        q.QUEUE_LABEL: lq["metadata"]["name"],
        q.PRIORITY_LABEL: q.EXPERIMENTS,
    }
    ours = [
        m
        for m in manifests
        if m["apiVersion"].startswith("kueue.x-k8s.io/") or m["metadata"]["name"].endswith(".kueue.x-k8s.io")
    ]
    assert len(ours) == 7 + 3 + 1 + 1 + len(served)  # CRDs (the controller's included), priorities, flavor, queues
    assert mf.validate(manifests, stack.cfg.cluster.kubernetes_version) == []
    # The schemas are closed and keep Kueue's constraints: a misspelt field or a bad policy is caught.
    broken = copy.deepcopy(cq)
    broken["spec"]["preemption"]["withinClusterQueue"] = "Always"
    broken["spec"]["resourceGroup"] = broken["spec"].pop("resourceGroups")
    crds = [m for m in manifests if m["kind"] == "CustomResourceDefinition"]
    problems = mf.validate([*crds, broken], stack.cfg.cluster.kubernetes_version)
    assert {p.path for p in problems} == {"spec", "spec.preemption.withinClusterQueue"}
