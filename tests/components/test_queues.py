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
from supernode.core.config import from_mapping, load_stack
from supernode.core.plan import build_plan
from supernode.tools import manifests as mf


def _quantity(amount: str) -> int:
    return int(amount.removesuffix("Gi"))


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_each_roles_quota_is_the_plans_pool_and_its_node_groups_hardware(stack):
    cfg = load_stack(stack, ROOT)
    plan = build_plan(stack, cfg)
    [pool] = q.gpu_pools(cfg.accelerator_node_groups, plan)  # prod's three p5 groups are one H100 pool
    [figures] = plan.pools
    assert pool.figures == figures  # the queues read the plan's arithmetic, never their own
    hw = CATALOG[plan.instance_type]
    # training's quota is its instances: the world's nodes and the spares (prod: one)
    training_nodes = sum(g.nodes + g.spares for g in cfg.accelerator_node_groups if g.role == "training")
    serving_nodes = sum(g.nodes for g in cfg.accelerator_node_groups if g.role == "serving")
    assert training_nodes == plan.nodes + plan.spare_nodes and serving_nodes >= 1
    assert plan.spare_nodes == {"dev": 0, "prod": 1}[stack]
    training, serving = pool.quota("training"), pool.quota("serving")
    assert training["nvidia.com/gpu"] == str(figures.training_devices) == str(training_nodes * hw.accelerators)
    assert figures.training_devices - figures.spare_devices == plan.world_size
    assert serving["nvidia.com/gpu"] == str(figures.serving_devices) == str(serving_nodes * hw.accelerators)
    assert training["vpc.amazonaws.com/efa"] == str(training_nodes * hw.efa_interfaces)
    # The trainer's pods ask for nothing the queue does not cover, and training's quota is exactly all
    # of them: the job is admitted whole or not at all.
    requests = pod_resources(plan.pod)["requests"]
    spec = q.cluster_queue_spec(pool, [cfg.workload.namespace])
    assert set(requests) == set(spec["resourceGroups"][0]["coveredResources"])
    for resource, amount in requests.items():
        assert _quantity(training[resource]) == training_nodes * _quantity(amount)
        assert _quantity(serving[resource]) == serving_nodes * _quantity(amount)
    # Training lends what the plan says it can give up (its share less its spares and its minimum), no
    # more: dev is not elastic, prod runs down to training.minNodes 8 of 16 nodes.
    flavor, borrowed = spec["resourceGroups"][0]["flavors"]
    lending = {r["name"]: r.get("lendingLimit") for r in flavor["resources"]}
    assert lending["nvidia.com/gpu"] == figures.training_lending_limit == {"dev": 0, "prod": 64}[stack]
    assert spec["preemption"]["reclaimWithinCohort"] == "Any"  # lent quota comes back without a person
    # ... and it may borrow serving's idle share (its share less its minimum: dev 8 - 1, prod 32 - 32) on
    # serving's flavor, nominal 0: Kueue borrows per flavor, so without it training never reaches serving's nodes.
    assert borrowed["name"] == pool.serving_name
    assert {r["name"]: r["nominalQuota"] for r in borrowed["resources"]} == dict.fromkeys(training, "0")
    limits = {r["name"]: r.get("borrowingLimit") for r in borrowed["resources"]}
    assert limits == {**dict.fromkeys(training), "nvidia.com/gpu": {"dev": 7, "prod": 0}[stack]}
    # Serving: its own flavor (lending its idle share above its minimum), training's to borrow what
    # training lends, and it never evicts training to borrow.
    sspec = q.serving_cluster_queue_spec(pool, [cfg.inference.namespace])
    sflavor, sborrowed = sspec["resourceGroups"][0]["flavors"]
    assert sflavor["name"] == pool.serving_name != pool.name == sborrowed["name"]
    assert {r["name"]: r["nominalQuota"] for r in sflavor["resources"]} == serving
    assert {r["name"]: r.get("lendingLimit") for r in sflavor["resources"]}["nvidia.com/gpu"] == {"dev": 7, "prod": 0}[
        stack
    ]
    gpu = {r["name"]: r for r in sborrowed["resources"]}["nvidia.com/gpu"]
    assert (gpu["nominalQuota"], gpu["borrowingLimit"]) == ("0", figures.serving_borrowing_limit)
    assert sspec["preemption"]["borrowWithinCohort"] == {"policy": "Never"}
    assert sspec["preemption"]["reclaimWithinCohort"] == "Any"  # its idle share back when it scales out
    # Serving's minimum fits its share, and so does its maximum here: it scales out without borrowing.
    assert figures.serving_min <= figures.serving_max <= figures.serving_devices


def test_flavors_keep_training_and_serving_on_their_own_nodes():
    plan = build_plan("dev", load_stack("dev", ROOT))
    [pool] = q.gpu_pools(load_stack("dev", ROOT).accelerator_node_groups, plan)
    training, serving = q.flavor_spec(pool, "training"), q.flavor_spec(pool, "serving")
    assert training["nodeLabels"][q.ROLE_LABEL] == "training" and serving["nodeLabels"][q.ROLE_LABEL] == "serving"
    assert training["nodeLabels"][q.ACCELERATOR_LABEL] == serving["nodeLabels"][q.ACCELERATOR_LABEL] == "H100"


def test_a_role_may_have_its_own_node_shape_but_not_two(monkeypatch):
    """Serving's nodes may be another H100 instance type than training's (their flavors and quotas are
    apart); two shapes in one role's flavor would make its quota lie."""
    from dataclasses import replace

    small = replace(CATALOG["p5.48xlarge"], name="p5.half", accelerators=4, efa_interfaces=2, vcpus=96, memory_gib=1024)
    monkeypatch.setitem(CATALOG, small.name, small)
    cfg = load_stack("dev", ROOT)
    plan = build_plan("dev", cfg)
    [training, serving] = cfg.accelerator_node_groups
    [pool] = q.gpu_pools([training, serving.model_copy(update={"instance_type": small.name})], plan)
    assert pool.shapes["serving"].gpus == 4 and pool.shapes["training"].gpus == 8
    with pytest.raises(Exception, match="one Kueue flavor needs one node shape"):
        q.gpu_pools([training, training.model_copy(update={"name": "b", "instance_type": small.name})], plan)


def test_priorities_order_serving_training_experiments():
    v = {name: value for name, (value, _) in q.PRIORITIES.items()}
    assert v[q.SERVING] > v[q.TRAINING] > v[q.EXPERIMENTS]
    cfg = load_stack("dev", ROOT)
    [pool] = q.gpu_pools(cfg.accelerator_node_groups, build_plan("dev", cfg))
    pre = q.cluster_queue_spec(pool, ["training"])["preemption"]
    # borrowed quota is reclaimed only from experiments, never from training or serving
    assert pre["borrowWithinCohort"]["maxPriorityThreshold"] == v[q.EXPERIMENTS]


def role_affinity(pod: dict) -> list[str]:
    """The node roles (ROLE_LABEL) a pod's required node affinity admits (all its expressions on it)."""
    [term] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    roles = {"training", "serving"}
    for e in term["matchExpressions"]:
        if e["key"] == q.ROLE_LABEL:
            roles &= set(e["values"])
    return sorted(roles)


@pytest.mark.slow
def test_kueue_objects_in_the_preview_are_wired_and_valid():
    stack = preview("dev")
    manifests = mf.from_resources(stack.result.resources)
    kinds = {}
    for m in manifests:
        kinds.setdefault(m["kind"], []).append(m)
    assert len(kinds["WorkloadPriorityClass"]) == 3 and len(kinds["ResourceFlavor"]) == 2
    cqs = {m["metadata"]["name"]: m for m in kinds["ClusterQueue"]}
    [plan_pool] = build_plan("dev", stack.cfg).pools
    cq, serving_cq = cqs.pop("gpu-h100"), cqs.pop("gpu-h100-serving")
    assert not cqs
    [job] = [r.inputs for r in stack.all(T.PYTORCH_JOB)]
    labels = job["metadata"]["labels"]
    ns, serving_ns = stack.cfg.workload.namespace, stack.cfg.inference.namespace
    # one LocalQueue per queued namespace: training's feeds training's ClusterQueue, serving's serving's
    lqs = {m["metadata"]["namespace"]: m for m in kinds["LocalQueue"]}
    served = set(lqs)
    assert served == {ns, serving_ns}
    assert cq["spec"]["namespaceSelector"]["matchExpressions"][0]["values"] == [ns]
    assert serving_cq["spec"]["namespaceSelector"]["matchExpressions"][0]["values"] == [serving_ns]
    lq = lqs[ns]
    # the trainer names a LocalQueue of its namespace, which feeds a ClusterQueue serving that namespace
    assert (lq["metadata"]["namespace"], lq["metadata"]["name"]) == (ns, labels[q.QUEUE_LABEL])
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert lqs[serving_ns]["spec"]["clusterQueue"] == serving_cq["metadata"]["name"]
    # the quotas in the manifests are the plan's figures
    gpus = {
        (name, f["name"]): {r["name"]: r for r in f["resources"]}["nvidia.com/gpu"]
        for name, c in (("training", cq), ("serving", serving_cq))
        for f in c["spec"]["resourceGroups"][0]["flavors"]
    }
    assert int(gpus["training", "gpu-h100"]["nominalQuota"]) == plan_pool.training_devices
    assert gpus["training", "gpu-h100"]["lendingLimit"] == plan_pool.training_lending_limit
    assert int(gpus["serving", "gpu-h100-serving"]["nominalQuota"]) == plan_pool.serving_devices
    # each queue reaches the other role's nodes on that role's flavor, nominal 0: training borrows serving's
    # idle share (8 GPUs less its minimum replica), serving borrows what training lends (dev: nothing)
    assert gpus["serving", "gpu-h100-serving"]["lendingLimit"] == plan_pool.serving_lending_limit == 7
    assert gpus["training", "gpu-h100-serving"] == {"name": "nvidia.com/gpu", "nominalQuota": "0", "borrowingLimit": 7}
    assert gpus["serving", "gpu-h100"]["nominalQuota"] == "0"
    assert gpus["serving", "gpu-h100"]["borrowingLimit"] == plan_pool.serving_borrowing_limit
    # ... and their pods may land there: Kueue puts the admitted flavor's node labels into their node
    # selector, so neither's own affinity may rule the other role's nodes out
    flavors = {m["metadata"]["name"]: m["spec"]["nodeLabels"][q.ROLE_LABEL] for m in kinds["ResourceFlavor"]}
    assert flavors == {"gpu-h100": "training", "gpu-h100-serving": "serving"}
    # serving's pods queue in serving's LocalQueue, and their PriorityClass never evicts a training pod
    [deployment] = [
        m
        for m in manifests
        if m["kind"] == "Deployment"
        and m["metadata"]["namespace"] == serving_ns
        and m["spec"]["template"]["metadata"]["labels"].get(q.QUEUE_LABEL)
    ]
    assert deployment["spec"]["template"]["metadata"]["labels"][q.QUEUE_LABEL] == lqs[serving_ns]["metadata"]["name"]
    assert role_affinity(deployment["spec"]["template"]["spec"]) == ["serving", "training"]
    assert role_affinity(job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]) == ["serving", "training"]
    # the gate, which no queue places, stays on training's nodes (the world it checks)
    [gate] = [m for m in manifests if m["kind"] == "Job" and q.QUEUE_LABEL not in m["metadata"].get("labels", {})]
    assert role_affinity(gate["spec"]["template"]["spec"]) == ["training"]
    [serving_pc] = [m for m in kinds["PriorityClass"] if m["metadata"]["name"] == "supernode-serving"]
    assert serving_pc["preemptionPolicy"] == "Never"
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
        if m["apiVersion"].startswith("kueue.x-k8s.io/")
        or (m["kind"] == "CustomResourceDefinition" and m["metadata"]["name"].endswith(".kueue.x-k8s.io"))
    ]  # not the visibility APIService (v1beta1.visibility.kueue.x-k8s.io, test_queue_metrics.py)
    assert len(ours) == 7 + 3 + 2 + 2 + len(served)  # CRDs (the controller's included), priorities, flavors, queues
    assert mf.validate(manifests, stack.cfg.cluster.kubernetes_version) == []
    # The schemas are closed and keep Kueue's constraints: a misspelt field or a bad policy is caught.
    broken = copy.deepcopy(cq)
    broken["spec"]["preemption"]["withinClusterQueue"] = "Always"
    broken["spec"]["resourceGroup"] = broken["spec"].pop("resourceGroups")
    crds = [m for m in manifests if m["kind"] == "CustomResourceDefinition"]
    problems = mf.validate([*crds, broken], stack.cfg.cluster.kubernetes_version)
    assert {p.path for p in problems} == {"spec", "spec.preemption.withinClusterQueue"}


def test_serving_borrows_what_training_lends_on_training_s_flavor():
    """prod with 3 replicas of 16 GPUs: 16 beyond serving's 32, lent by the elastic job (64), reached only
    through training's flavor in serving's queue (Kueue borrows per flavor); and serving's queue takes
    its own share back (reclaimWithinCohort) from a training job borrowing it."""
    data = copy.deepcopy(load_stack("prod", ROOT).to_mapping())
    data["inference"].update(replicasMax=3)
    cfg = from_mapping(data, "prod variant")
    [pool] = q.gpu_pools(cfg.accelerator_node_groups, build_plan("prod", cfg))
    spec = q.serving_cluster_queue_spec(pool, ["serving"])
    [group] = spec["resourceGroups"]
    assert [f["name"] for f in group["flavors"]] == ["gpu-h100-serving", "gpu-h100"]
    for f in group["flavors"]:  # every flavor lists the covered resources, in their order (Kueue's rule)
        assert [r["name"] for r in f["resources"]] == group["coveredResources"]
    gpu = {r["name"]: r for r in group["flavors"][1]["resources"]}["nvidia.com/gpu"]
    assert (gpu["nominalQuota"], gpu["borrowingLimit"]) == ("0", 16) and pool.figures.training_lending_limit == 64
    assert spec["preemption"]["reclaimWithinCohort"] == "Any"
