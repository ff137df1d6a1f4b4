"""Kueue: queues, quotas, gang admission and priorities for the GPU pools (issue 18, item 3).

- One ResourceFlavor and one ClusterQueue per GPU pool: the accelerator node groups of one
  accelerator (their `supernode.io/accelerator` label), with nominal quota = the pool's nodes x the
  whole-node pod shape (GPUs, EFA devices, CPU, memory, huge pages), so the quota is exactly the
  hardware the node groups buy. The ClusterQueues share one cohort.
- A LocalQueue per served namespace (training; serving when it exists) pointing at each pool.
- WorkloadPriorityClasses: serving > training > experiments (docs/architecture.md, "Operations").
- A job names its LocalQueue and priority with labels (`job_labels`). Kueue admits a job as one
  Workload: quota for all of its pods or none (no half-scheduled job holding GPUs); the controller's
  waitForPodsReady evicts and requeues a job whose admitted pods do not all become ready.

The CRDs are the trimmed schemas in components/crds/kueue-*.yaml, installed here so that the objects
are validated against them (`supernode preview --manifests`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import pulumi
import pulumi_kubernetes as k8s

from supernode.core.capacity import PodShape
from supernode.core.catalog import CATALOG
from supernode.core.config import AcceleratorNodeGroup
from supernode.core.plan import Plan

from .workload_common import PART_OF, dns_name, gib, load_crd, meta

KUEUE_API = "kueue.x-k8s.io/v1beta1"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ACCELERATOR_LABEL = "supernode.io/accelerator"  # set on every GPU node by its node group
COHORT = "supernode-gpu"
CRD_FILES = ("kueue-resourceflavors.yaml", "kueue-clusterqueues.yaml", "kueue-localqueues.yaml",
             "kueue-workloadpriorityclasses.yaml")
# Kueue priorities (higher first). Serving is user-facing; a training job checkpoints on SIGTERM and
# resumes, so it yields to serving; experiments (ad-hoc runs, the scheduled fabric check) yield to both.
PRIORITIES = {"supernode-serving": (1000, "inference serving: preempts training and experiments"),
              "supernode-training": (500, "training jobs: preempt experiments, yield to serving"),
              "supernode-experiments": (100, "experiments and scheduled checks: run on free GPU nodes only")}
TRAINING, SERVING, EXPERIMENTS = "supernode-training", "supernode-serving", "supernode-experiments"


@dataclass(frozen=True)
class Pool:
    """GPU nodes of one accelerator and the quota they give."""

    accelerator: str
    nodes: int
    shape: PodShape  # one whole-node pod

    @property
    def name(self) -> str:
        return queue_name(self.accelerator)

    def quota(self) -> dict[str, str]:
        """Nominal quota: the pool's nodes x the node's pod shape (Kubernetes quantities)."""
        n, s = self.nodes, self.shape
        quota = {"nvidia.com/gpu": str(n * s.gpus), "vpc.amazonaws.com/efa": str(n * s.efa), "cpu": str(n * s.cpu),
                 "memory": gib(n * s.memory_gib)}
        if s.hugepages_gib:
            quota["hugepages-2Mi"] = gib(n * s.hugepages_gib)
        return quota


def gpu_pools(groups: Sequence[AcceleratorNodeGroup], plan: Plan) -> list[Pool]:
    """The pools of the node groups (by accelerator), or the plan's one pool without groups."""
    if not groups:
        return [Pool(plan.hardware.accelerator, plan.nodes, plan.pod)]
    pools: dict[str, Pool] = {}
    for g in groups:
        hw = CATALOG[g.instance_type]
        shape = PodShape.for_node(hw, plan.pod.hugepages_gib)
        seen = pools.get(hw.accelerator)
        if seen is not None and seen.shape != shape:
            raise pulumi.RunError(f"node group {g.name}: {g.instance_type} gives a different node shape than the other "
                                  f"{hw.accelerator} groups; one Kueue pool needs one node shape")
        pools[hw.accelerator] = Pool(hw.accelerator, (seen.nodes if seen else 0) + g.nodes, shape)
    return list(pools.values())


def queue_name(accelerator: str) -> str:
    """The pool's flavor and ClusterQueue, and its LocalQueue in every served namespace: gpu-h100."""
    return dns_name("gpu", accelerator)


def job_labels(plan: Plan, priority: str) -> dict[str, str]:
    """The labels that put a job in its pool's LocalQueue at a priority."""
    return {QUEUE_LABEL: queue_name(plan.hardware.accelerator), PRIORITY_LABEL: priority}


def cluster_queue_spec(pool: Pool, namespaces: Sequence[str]) -> dict[str, Any]:
    quota = pool.quota()
    return {
        "cohort": COHORT,
        "namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(namespaces)}]},
        # A big job at the head does not block smaller ones that fit (they cannot starve it: it keeps
        # its place, and preemption below frees nodes for higher priorities).
        "queueingStrategy": "BestEffortFIFO",
        "resourceGroups": [{"coveredResources": list(quota), "flavors": [{
            "name": pool.name, "resources": [{"name": r, "nominalQuota": q} for r, q in quota.items()]}]}],
        "preemption": {
            "withinClusterQueue": "LowerPriority",
            "reclaimWithinCohort": "Any",  # quota lent to another pool's queue comes back when needed
            # Borrowed quota may be taken back only from experiments, never from training or serving.
            "borrowWithinCohort": {"policy": "LowerPriority", "maxPriorityThreshold": PRIORITIES[EXPERIMENTS][0]},
        },
    }


class TopLevelResource(pulumi.CustomResource):
    """A custom resource with its fields at the top level, which k8s.apiextensions.CustomResource
    (metadata and spec only) cannot send: a WorkloadPriorityClass has `value` and `description`."""

    def __init__(self, name: str, api_version: str, kind: str, metadata: dict, fields: dict,
                 opts: pulumi.ResourceOptions):
        super().__init__(f"kubernetes:{api_version}:{kind}", name,
                         {"apiVersion": api_version, "kind": kind, "metadata": metadata, **fields}, opts)


@dataclass(frozen=True)
class QueuesArgs:
    pools: Sequence[Pool]
    namespaces: Sequence[str]  # namespaces with a LocalQueue per pool (training; serving when it exists)
    after: Sequence[pulumi.Resource] = ()  # the namespaces themselves


class Queues(pulumi.ComponentResource):
    def __init__(self, name: str, args: QueuesArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("supernode:workload:Queues", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.crds = {}
        for filename in CRD_FILES:
            crd = load_crd(filename)
            crd["metadata"]["labels"] = dict(PART_OF)
            kind = crd["spec"]["names"]["kind"]
            self.crds[kind] = k8s.apiextensions.v1.CustomResourceDefinition(
                f"{name}-{kind.lower()}-crd", metadata=crd["metadata"], spec=crd["spec"], opts=child)

        def custom(resource: str, kind: str, metadata: dict, after: Sequence[pulumi.Resource] = (),
                   **body: Any) -> pulumi.CustomResource:
            opts = pulumi.ResourceOptions(parent=self, depends_on=[self.crds[kind], *after])
            if set(body) == {"spec"}:
                return k8s.apiextensions.CustomResource(resource, api_version=KUEUE_API, kind=kind, metadata=metadata,
                                                        spec=body["spec"], opts=opts)
            return TopLevelResource(resource, KUEUE_API, kind, metadata, body, opts)

        self.priority_classes = [custom(f"{name}-{p}", "WorkloadPriorityClass", meta(p), value=value,
                                        description=text) for p, (value, text) in PRIORITIES.items()]
        self.local_queues = []
        self.cluster_queues = []
        for pool in args.pools:
            flavor = custom(f"{name}-{pool.name}-flavor", "ResourceFlavor", meta(pool.name),
                            spec={"nodeLabels": {ACCELERATOR_LABEL: pool.accelerator}})
            cq = custom(f"{name}-{pool.name}", "ClusterQueue", meta(pool.name), after=[flavor],
                        spec=cluster_queue_spec(pool, args.namespaces))
            self.cluster_queues.append(cq)
            for ns in args.namespaces:
                self.local_queues.append(custom(
                    f"{name}-{ns}-{pool.name}", "LocalQueue", meta(queue_name(pool.accelerator), ns),
                    after=[cq, *args.after], spec={"clusterQueue": pool.name}))
        # What a queued job waits for: its LocalQueue and the priority classes it names.
        self.ready: list[pulumi.Resource] = [*self.local_queues, *self.priority_classes]
        self.register_outputs({"cluster_queues": [p.name for p in args.pools]})
