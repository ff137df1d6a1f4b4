"""Kueue: queues, quotas, gang admission and priorities for the GPU pools (issue 18, item 3).

- Per GPU pool (the accelerator node groups of one accelerator, their `supernode.io/accelerator`
  label), the Plan's pool arithmetic (supernode.core.pools, `Plan.pools`) written as quotas, never
  recomputed (docs/architecture.md, "How training and serving share the accelerators"):
  - training's ResourceFlavor and ClusterQueue `gpu-<acc>`: the training groups' nodes, spares
    included (`supernode.io/gpu-role: training`), nominal quota = those nodes x the whole-node pod
    shape (GPUs, EFA devices, CPU, memory, huge pages), so the quota is exactly the hardware they
    buy; it lends at most what the elastic job can give up, its share less its spares and its
    minimum (`lendingLimit`; training.minNodes), and takes lent quota back (`reclaimWithinCohort`),
    so a training job waiting behind borrowed quota is re-admitted unaided;
  - serving's ResourceFlavor and ClusterQueue `gpu-<acc>-serving` (where the stack serves): the
    serving groups' nodes, its nominal quota; it never preempts across the cohort
    (`borrowWithinCohort: Never`), and borrows only what training lends.
  Kueue puts the admitted flavor's node labels into the pods' node selector, so neither lands on the
  other's nodes (no fragmentation of the whole nodes the training job needs). One cohort.
- A LocalQueue `gpu-<acc>` in each queued namespace: training's points at training's ClusterQueue,
  serving's at serving's.
- WorkloadPriorityClasses: serving > training > experiments (docs/architecture.md, "Operations").
- A job names its LocalQueue and priority with labels (`job_labels`). Kueue admits a job as one
  Workload: quota for all of its pods or none (no half-scheduled job holding GPUs); the controller's
  waitForPodsReady evicts and requeues a job whose admitted pods do not all become ready.

The controller (`KueueController`) is the pinned add-on file components/addons/kueue.yaml: its
configuration turns on waitForPodsReady with blockAdmission, and its webhooks admit jobs and serving pods
in the queued namespaces only. It comes first: everything its webhooks intercept (the jobs, the serving
workload) and the queue objects themselves are created after it is ready, and deleted before it, so its
finalizers are always removed. The CRDs are the trimmed schemas in components/crds/kueue-*.yaml, installed
with the controller (it will not start without them), so the objects are validated against them
(`supernode preview --manifests`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from supernode.core.capacity import PodShape
from supernode.core.catalog import CATALOG
from supernode.core.config import AcceleratorNodeGroup
from supernode.core.plan import Plan
from supernode.core.pools import ROLE_LABEL, TeamPool, TeamShare
from supernode.core.pools import Pool as PoolFigures
from supernode.core.teams import WORKLOAD_PRIORITY
from supernode.core.teams import cluster_queue as team_cluster_queue

from .addons import webhook_controller
from .common import (
    crd_kind,
    dns_name,
    load_addon,
    meta,
    namespace_selector,
    pod_resources,
    pod_security_namespace,
    shipped_crd,
)

KUEUE_API = "kueue.x-k8s.io/v1beta1"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ACCELERATOR_LABEL = "supernode.io/accelerator"  # set on every GPU node by its node group
COHORT = "supernode-gpu"
# Every kind the controller watches (it will not start without their CRDs), the stack's objects' first.
CRD_FILES = (
    "kueue-resourceflavors.yaml",
    "kueue-clusterqueues.yaml",
    "kueue-localqueues.yaml",
    "kueue-workloadpriorityclasses.yaml",
    "kueue-workloads.yaml",
    "kueue-admissionchecks.yaml",
    "kueue-cohorts.yaml",
)
CONTROLLER_FILE = "kueue.yaml"  # its container `kueue` is its images.addons entry
CONTROLLER_NAMESPACE = "kueue-system"  # where the file places its namespaced objects (and its configuration says)
CONFIG_KEY = "controller_manager_config.yaml"  # the Configuration in the ConfigMap
# Kueue priorities (higher first), which order work within a ClusterQueue: training and serving have
# queues and quotas of their own (the Plan's pools), so neither preempts the other; experiments (ad-hoc
# runs, the scheduled fabric check) yield to training on its nodes.
PRIORITIES = {
    "supernode-serving": (1000, "inference serving: its own quota (the serving node groups); preempts no training"),
    "supernode-training": (500, "training jobs: preempt experiments; their quota is never serving's"),
    "supernode-experiments": (100, "experiments and scheduled checks: run on free GPU nodes only"),
}
TRAINING, SERVING, EXPERIMENTS = "supernode-training", "supernode-serving", "supernode-experiments"
# With teams (supernode:teams), a job file's `priority: high` (supernode.core.teams.WORKLOAD_PRIORITY):
# above training's, below serving's.
TRAINING_HIGH = WORKLOAD_PRIORITY["high"]
TEAM_PRIORITIES = {
    TRAINING_HIGH: (750, "a team's urgent training jobs: preempt its normal and low ones; below serving"),
}
# Kueue's fair sharing among the teams' ClusterQueues (each with its weight): a queue is preempted only
# while its share stays at or above the preemptor's after the preemption, else while below it before.
FAIR_SHARING = {"enable": True, "preemptionStrategies": ["LessThanOrEqualToFinalShare", "LessThanInitialShare"]}


@dataclass(frozen=True)
class Pool:
    """GPU nodes of one accelerator, the quotas they give, and the Plan's arithmetic behind them."""

    figures: PoolFigures  # Plan.pools: the devices, each side's min and max, the lending and borrowing limits
    shapes: Mapping[str, PodShape]  # one whole-node pod of each role's nodes (a role has one node shape)

    @property
    def accelerator(self) -> str:
        return self.figures.accelerator

    @property
    def name(self) -> str:
        """Training's flavor and ClusterQueue, and the LocalQueue in every queued namespace."""
        return queue_name(self.accelerator)

    @property
    def serving_name(self) -> str:
        return f"{self.name}-serving"

    @property
    def serves(self) -> bool:
        """Serving has a queue in this pool: its reserved nodes, or replicas to run."""
        return bool(self.figures.serving_nodes or self.figures.serving_max)

    def quota(self, role: str = "training", nodes: int | None = None) -> dict[str, str]:
        """Nominal quota of a role's flavor: its nodes (or `nodes`) x its node's pod shape (Kubernetes
        quantities)."""
        if nodes is None:
            nodes = self.figures.training_nodes if role == "training" else self.figures.serving_nodes
        shape = self.shapes.get(role, self.shapes["training"])  # no serving nodes: a quota of 0 of its kind
        return pod_resources(shape.times(nodes))["requests"]


def gpu_pools(groups: Sequence[AcceleratorNodeGroup], plan: Plan) -> list[Pool]:
    """The plan's pools (by accelerator) with each role's node shape."""
    shapes: dict[str, dict[str, tuple[str, PodShape]]] = {}
    for g in groups:
        hw = CATALOG[g.instance_type]
        shape = PodShape.for_node(hw, plan.pod.hugepages_gib)
        seen = shapes.setdefault(hw.accelerator, {}).get(g.role)
        if seen is not None and seen[1] != shape:
            raise pulumi.RunError(
                f"node group {g.name}: {g.instance_type} gives a different node shape than the other "
                f"{hw.accelerator} {g.role} group {seen[0]}; one Kueue flavor needs one node shape"
            )
        shapes[hw.accelerator].setdefault(g.role, (g.name, shape))
    return [Pool(f, {role: shape for role, (_, shape) in shapes[f.accelerator].items()}) for f in plan.pools]


def queue_name(accelerator: str) -> str:
    """The pool's flavor and ClusterQueue, and its LocalQueue in every served namespace: gpu-h100."""
    return dns_name("gpu", accelerator)


def job_labels(plan: Plan, priority: str) -> dict[str, str]:
    """The labels that put a job in its pool's LocalQueue at a priority."""
    return {QUEUE_LABEL: queue_name(plan.hardware.accelerator), PRIORITY_LABEL: priority}


def flavor_spec(pool: Pool, role: str) -> dict[str, Any]:
    """A role's nodes of the pool: Kueue adds these labels to an admitted pod's node selector."""
    return {"nodeLabels": {ACCELERATOR_LABEL: pool.accelerator, ROLE_LABEL: role}}


def _resources(quota: Mapping[str, str], limits: Mapping[str, Mapping[str, int]]) -> list[dict[str, Any]]:
    """A flavor's resources: nominal quotas, and the limits (lendingLimit, borrowingLimit) on some."""
    return [{"name": r, "nominalQuota": q, **{k: v[r] for k, v in limits.items() if r in v}} for r, q in quota.items()]


def _flavors(
    pool: Pool, role: str, quota: Mapping[str, str], limits: Mapping[str, Mapping[str, int]], borrowed: int | None
) -> list[dict[str, Any]]:
    """A role's ClusterQueue's flavors: its own (its nominal quota and limits), and with `borrowed` the
    other role's flavor at nominal 0, borrowing up to that many devices. Kueue borrows per flavor, so a
    queue reaches the other role's nodes only through that flavor (whose node labels it then puts on the
    admitted pods); training's queues borrow serving's flavor, serving's queue training's."""
    own, other = (pool.name, pool.serving_name) if role == "training" else (pool.serving_name, pool.name)
    flavors = [{"name": own, "resources": _resources(quota, limits)}]
    if borrowed is not None:
        device = {"borrowingLimit": {pool.figures.device_resource: borrowed}}
        flavors.append({"name": other, "resources": _resources(dict.fromkeys(quota, "0"), device)})
    return flavors


def _cluster_queue(
    namespaces: Sequence[str], flavors: list[dict[str, Any]], preemption: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    """A ClusterQueue of the cohort serving `namespaces`: one resource group over its flavors."""
    return {
        "cohort": COHORT,
        "namespaceSelector": namespace_selector(namespaces),
        # A big job at the head does not block smaller ones that fit (they cannot starve it: it keeps
        # its place, and preemption below frees nodes for higher priorities).
        "queueingStrategy": "BestEffortFIFO",
        "resourceGroups": [{"coveredResources": [r["name"] for r in flavors[0]["resources"]], "flavors": flavors}],
        "preemption": preemption,
        **extra,
    }


def _borrows_serving(pool: Pool) -> int | None:
    """What a training queue may borrow of serving's idle share (preemptibly), where the pool serves."""
    return pool.figures.training_borrowing_limit if pool.serves else None


def cluster_queue_spec(pool: Pool, namespaces: Sequence[str]) -> dict[str, Any]:
    """Training's ClusterQueue: the training nodes' quota, lending what training can give up, and
    borrowing serving's idle share."""
    quota = pool.quota("training")
    device = pool.figures.device_resource
    limits = {"lendingLimit": {device: pool.figures.training_lending_limit}} if pool.serves else {}
    preemption = {
        "withinClusterQueue": "LowerPriority",
        # Quota lent to serving comes back when training needs it: a training job waiting behind
        # borrowed quota is re-admitted without a person.
        "reclaimWithinCohort": "Any",
        # Borrowed quota may be taken back only from experiments, never from training or serving.
        "borrowWithinCohort": {"policy": "LowerPriority", "maxPriorityThreshold": PRIORITIES[EXPERIMENTS][0]},
    }
    return _cluster_queue(namespaces, _flavors(pool, "training", quota, limits, _borrows_serving(pool)), preemption)


def serving_cluster_queue_spec(pool: Pool, namespaces: Sequence[str]) -> dict[str, Any]:
    """Serving's ClusterQueue: its reserved nodes' quota, lending what is idle above its minimum (which
    training's queues borrow, preemptibly). Beyond its share serving borrows only what training lends, on
    training's flavor (training's lendingLimit: its share less its spares and its minimum, 0 when the
    job is not elastic, so serving then scales out within its share)."""
    quota = pool.quota("serving")
    limits = {"lendingLimit": {pool.figures.device_resource: pool.figures.serving_lending_limit}}
    preemption = {
        "withinClusterQueue": "LowerPriority",
        "reclaimWithinCohort": "Any",  # its reserved share back from training when it scales out
        "borrowWithinCohort": {"policy": "Never"},  # scale-out never evicts training to borrow
    }
    return _cluster_queue(
        namespaces, _flavors(pool, "serving", quota, limits, pool.figures.serving_borrowing_limit), preemption
    )


def team_cluster_queue_spec(pool: Pool, teams: TeamPool, team: TeamShare, namespaces: Sequence[str]) -> dict[str, Any]:
    """A team's ClusterQueue in the pool's cohort, on training's flavor: its nominal quota, borrowing
    and lending limits (the Plan's, in whole nodes x the node's pod shape for every covered resource)
    and its fair-sharing weight; like training's, it may borrow serving's idle share. Fair sharing
    decides what borrowed quota is taken back (Kueue ignores borrowWithinCohort under it); lent quota
    comes back when the team needs it."""
    per_node = teams.devices_per_node
    quota = pool.quota("training", team.nodes)
    limits = {
        "borrowingLimit": pool.quota("training", team.borrowing_limit // per_node),
        "lendingLimit": pool.quota("training", team.lending_limit // per_node),
    }
    return _cluster_queue(
        namespaces,
        _flavors(pool, "training", quota, limits, _borrows_serving(pool)),
        {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any"},
        fairSharing={"weight": f"{team.weight:g}"},
    )


class TopLevelResource(pulumi.CustomResource):
    """A custom resource with its fields at the top level, which k8s.apiextensions.CustomResource
    (metadata and spec only) cannot send: a WorkloadPriorityClass has `value` and `description`."""

    def __init__(
        self, name: str, api_version: str, kind: str, metadata: dict, fields: dict, opts: pulumi.ResourceOptions
    ):
        super().__init__(
            f"kubernetes:{api_version}:{kind}",
            name,
            {"apiVersion": api_version, "kind": kind, "metadata": metadata, **fields},
            opts,
        )


def controller_configuration(namespaces: Sequence[str], fair_sharing: bool = False) -> dict[str, Any]:
    """The controller's Configuration as shipped, managing the jobs of the queued namespaces only;
    with `fair_sharing` (the stack has teams) Kueue's fair sharing on, by the ClusterQueues' weights."""
    config = yaml.safe_load(load_addon(CONTROLLER_FILE)["ConfigMap"]["data"][CONFIG_KEY])
    config["managedJobsNamespaceSelector"] = namespace_selector(namespaces)
    if fair_sharing:
        config["fairSharing"] = dict(FAIR_SHARING)
    return config


def _intercepts_jobs(hook: dict[str, Any]) -> bool:
    """A webhook on a workload kind (pods, jobs, ...), not on Kueue's own API."""
    return any(group != KUEUE_API.split("/")[0] for rule in hook["rules"] for group in rule["apiGroups"])


@dataclass(frozen=True)
class KueueArgs:
    namespaces: Sequence[str]  # the queued namespaces: training; serving when it exists
    # images.addons: the `kueue` entry pins the controller by digest; without it, the file's tag.
    images: Mapping[str, str] = field(default_factory=dict)
    fair_sharing: bool = False  # the stack has teams: their ClusterQueues share by weight


class KueueController(pulumi.ComponentResource):
    """Kueue's CRDs and controller-manager (components/addons/kueue.yaml) in a namespace of its own (its
    Role reads the Secrets there: none but its certificate's). `ready`: the controller answers its
    webhooks, and so admits what the queued namespaces create."""

    def __init__(self, name: str, args: KueueArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:workload:Kueue", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.namespaces = sorted(args.namespaces)
        self.crds = {
            kind: shipped_crd(f"{name}-{kind.lower()}-crd", filename, child)
            for kind, filename in ((crd_kind(f), f) for f in CRD_FILES)
        }
        self.namespace = pod_security_namespace(f"{name}-ns", CONTROLLER_NAMESPACE, "restricted", "restricted", child)
        config = yaml.safe_dump(controller_configuration(self.namespaces, args.fair_sharing), sort_keys=False)
        self.deployment, self.version = webhook_controller(
            name,
            load_addon(CONTROLLER_FILE),
            self.namespace.metadata.name,
            child,
            role="namespace",
            config=(CONFIG_KEY, config),
            scoped=_intercepts_jobs,  # only where jobs are queued
            namespaces=self.namespaces,
            images=args.images,
            after=list(self.crds.values()),
        )
        self.ready: list[pulumi.Resource] = [self.deployment]
        self.register_outputs({"namespaces": self.namespaces, "version": self.version})


@dataclass(frozen=True)
class QueuesArgs:
    pools: Sequence[Pool]
    kueue: KueueController  # its CRDs, the namespaces it queues (a LocalQueue per pool in each), its readiness
    after: Sequence[pulumi.Resource] = ()  # the queued namespaces themselves
    serving_namespace: str | None = None  # its LocalQueues feed serving's ClusterQueues; the others training's
    # The Plan's team shares (Plan.teams) and each team's namespace: where a pool has them, training's
    # share is the teams' ClusterQueues (no gpu-<acc> ClusterQueue of its own), each team's namespace
    # queues in its own, and the other training namespaces (the stack's own job) in the first team's.
    teams: Sequence[TeamPool] = ()
    team_namespaces: Mapping[str, str] = field(default_factory=dict)  # team -> its namespace


class Queues(pulumi.ComponentResource):
    def __init__(self, name: str, args: QueuesArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:workload:Queues", name, None, opts)
        kueue = args.kueue

        def custom(
            resource: str, kind: str, metadata: dict, after: Sequence[pulumi.Resource] = (), **body: Any
        ) -> pulumi.CustomResource:
            # After the controller: its webhooks admit these objects, and it removes their finalizers on delete.
            opts = pulumi.ResourceOptions(parent=self, depends_on=[kueue.crds[kind], *kueue.ready, *after])
            if set(body) == {"spec"}:
                return k8s.apiextensions.CustomResource(
                    resource, api_version=KUEUE_API, kind=kind, metadata=metadata, spec=body["spec"], opts=opts
                )
            return TopLevelResource(resource, KUEUE_API, kind, metadata, body, opts)

        priorities = {**PRIORITIES, **(TEAM_PRIORITIES if args.teams else {})}
        self.priority_classes = [
            custom(f"{name}-{p}", "WorkloadPriorityClass", meta(p), value=value, description=text)
            for p, (value, text) in priorities.items()
        ]
        team_ns = set(args.team_namespaces.values())
        serving_ns = [ns for ns in kueue.namespaces if ns == args.serving_namespace]
        training_ns = [ns for ns in kueue.namespaces if ns != args.serving_namespace and ns not in team_ns]
        teams = {t.accelerator: t for t in args.teams}
        self.local_queues = []
        self.cluster_queues = []
        for pool in args.pools:
            flavors = [
                custom(f"{name}-{flavor}-flavor", "ResourceFlavor", meta(flavor), spec=flavor_spec(pool, role))
                for flavor, role in ((pool.name, "training"), (pool.serving_name, "serving"))
                if role == "training" or pool.serves  # every queue lists both where the pool serves
            ]
            shares = teams.get(pool.accelerator)
            if shares is None:
                queues = [(pool.name, cluster_queue_spec(pool, training_ns), training_ns)]
            else:
                queues = []
                for i, team in enumerate(shares.teams):
                    # the first team's queue also admits the stack's own job (its training namespace)
                    served = [args.team_namespaces[team.name], *(training_ns if i == 0 else [])]
                    spec = team_cluster_queue_spec(pool, shares, team, served)
                    queues.append((team_cluster_queue(team.name, pool.accelerator), spec, served))
            if serving_ns and pool.serves:
                queues.append((pool.serving_name, serving_cluster_queue_spec(pool, serving_ns), serving_ns))
            for cq_name, spec, namespaces in queues:
                cq = custom(f"{name}-{cq_name}", "ClusterQueue", meta(cq_name), after=flavors, spec=spec)
                self.cluster_queues.append(cq)
                for ns in namespaces:
                    self.local_queues.append(
                        custom(
                            f"{name}-{ns}-{pool.name}",
                            "LocalQueue",
                            meta(queue_name(pool.accelerator), ns),
                            after=[cq, *args.after],
                            spec={"clusterQueue": cq_name},
                        )
                    )
        # What a queued job waits for: its LocalQueue and the priority classes it names.
        self.ready: list[pulumi.Resource] = [*self.local_queues, *self.priority_classes]
        training_queues = [
            team_cluster_queue(t.name, p.accelerator) if p.accelerator in teams else p.name
            for p in args.pools
            for t in (teams[p.accelerator].teams if p.accelerator in teams else [None])
        ]
        self.register_outputs({"cluster_queues": training_queues})
