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

The controller (`KueueController`) is the pinned add-on file supernode/components/addons/kueue.yaml: its
configuration turns on waitForPodsReady with blockAdmission, and its webhooks admit jobs and serving pods
in the queued namespaces only. It comes first: everything its webhooks intercept (the jobs, the serving
workload) and the queue objects themselves are created after it is ready, and deleted before it, so its
finalizers are always removed. The CRDs are the trimmed schemas in supernode/components/crds/kueue-*.yaml, installed
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

from .addons import addon_resource, with_config_hash, with_images
from .common import crd_kind, dns_name, load_addon, meta, pod_resources, shipped_crd

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
# Kueue priorities (higher first). Serving is user-facing; a training job checkpoints on SIGTERM and
# resumes, so it yields to serving; experiments (ad-hoc runs, the scheduled fabric check) yield to both.
PRIORITIES = {
    "supernode-serving": (1000, "inference serving: preempts training and experiments"),
    "supernode-training": (500, "training jobs: preempt experiments, yield to serving"),
    "supernode-experiments": (100, "experiments and scheduled checks: run on free GPU nodes only"),
}
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
        return pod_resources(self.shape.times(self.nodes))["requests"]


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
            raise pulumi.RunError(
                f"node group {g.name}: {g.instance_type} gives a different node shape than the other "
                f"{hw.accelerator} groups; one Kueue pool needs one node shape"
            )
        pools[hw.accelerator] = Pool(hw.accelerator, (seen.nodes if seen else 0) + g.nodes, shape)
    return list(pools.values())


def queue_name(accelerator: str) -> str:
    """The pool's flavor and ClusterQueue, and its LocalQueue in every served namespace: gpu-h100."""
    return dns_name("gpu", accelerator)


def job_labels(plan: Plan, priority: str) -> dict[str, str]:
    """The labels that put a job in its pool's LocalQueue at a priority."""
    return {QUEUE_LABEL: queue_name(plan.hardware.accelerator), PRIORITY_LABEL: priority}


def namespace_selector(namespaces: Sequence[str]) -> dict[str, Any]:
    """The queued namespaces, by name: whom a ClusterQueue serves and whose jobs the controller manages."""
    return {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(namespaces)}]
    }


def cluster_queue_spec(pool: Pool, namespaces: Sequence[str]) -> dict[str, Any]:
    quota = pool.quota()
    return {
        "cohort": COHORT,
        "namespaceSelector": namespace_selector(namespaces),
        # A big job at the head does not block smaller ones that fit (they cannot starve it: it keeps
        # its place, and preemption below frees nodes for higher priorities).
        "queueingStrategy": "BestEffortFIFO",
        "resourceGroups": [
            {
                "coveredResources": list(quota),
                "flavors": [
                    {"name": pool.name, "resources": [{"name": r, "nominalQuota": q} for r, q in quota.items()]}
                ],
            }
        ],
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

    def __init__(
        self, name: str, api_version: str, kind: str, metadata: dict, fields: dict, opts: pulumi.ResourceOptions
    ):
        super().__init__(
            f"kubernetes:{api_version}:{kind}",
            name,
            {"apiVersion": api_version, "kind": kind, "metadata": metadata, **fields},
            opts,
        )


def controller_configuration(namespaces: Sequence[str]) -> dict[str, Any]:
    """The controller's Configuration as shipped, managing the jobs of the queued namespaces only."""
    config = yaml.safe_load(load_addon(CONTROLLER_FILE)["ConfigMap"]["data"][CONFIG_KEY])
    config["managedJobsNamespaceSelector"] = namespace_selector(namespaces)
    return config


def _intercepts_jobs(hook: dict[str, Any]) -> bool:
    """A webhook on a workload kind (pods, jobs, ...), not on Kueue's own API."""
    return any(group != KUEUE_API.split("/")[0] for rule in hook["rules"] for group in rule["apiGroups"])


@dataclass(frozen=True)
class KueueArgs:
    namespaces: Sequence[str]  # the queued namespaces: training; serving when it exists
    # images.addons: the `kueue` entry pins the controller by digest; without it, the file's tag.
    images: Mapping[str, str] = field(default_factory=dict)


class KueueController(pulumi.ComponentResource):
    """Kueue's CRDs and controller-manager (supernode/components/addons/kueue.yaml) in a namespace of its own (its
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
        self.namespace = k8s.core.v1.Namespace(
            f"{name}-ns",
            metadata=meta(
                CONTROLLER_NAMESPACE,
                labels={
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/warn": "restricted",
                },
            ),
            opts=child,
        )
        ns = self.namespace.metadata.name
        objs = load_addon(CONTROLLER_FILE)

        def create(suffix: str, obj: dict[str, Any], **options: Any) -> pulumi.CustomResource:
            namespace = ns if "namespace" in obj["metadata"] else None
            return addon_resource(
                f"{name}-{suffix}",
                obj,
                pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(**options)),
                namespace,
            )

        account = create("sa", objs["ServiceAccount"])

        def bind(binding: dict[str, Any], role: pulumi.CustomResource) -> dict[str, Any]:
            binding["roleRef"]["name"] = role.metadata.name
            for subject in binding["subjects"]:
                subject.update(name=account.metadata.name, namespace=ns)
            return binding

        bindings = [
            create("manager", bind(objs["ClusterRoleBinding"], create("manager", objs["ClusterRole"]))),
            create("namespace", bind(objs["RoleBinding"], create("namespace", objs["Role"]))),
        ]
        # Kueue writes and rotates the certificate in this Secret, and injects its CA into both webhook
        # configurations: Pulumi must not fight over either.
        cert = create("webhook-cert", objs["Secret"], ignore_changes=["data"])
        service = create("webhook", objs["Service"])
        config = yaml.safe_dump(controller_configuration(self.namespaces), sort_keys=False)
        config_map = create("config", {**objs["ConfigMap"], "data": {CONFIG_KEY: config}})
        webhooks = []
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            for hook in objs[kind]["webhooks"]:
                hook["clientConfig"]["service"].update(name=service.metadata.name, namespace=ns)
                if _intercepts_jobs(hook):  # fails closed: only where jobs are queued
                    hook["namespaceSelector"] = namespace_selector(self.namespaces)
            webhooks.append(
                create(
                    kind.removesuffix("Configuration").lower(),
                    objs[kind],
                    ignore_changes=["webhooks[*].clientConfig.caBundle"],
                )
            )

        # Its pods restart with a changed configuration (read once at start).
        deployment = with_config_hash(with_images(objs["Deployment"], args.images), config)
        pod = deployment["spec"]["template"]["spec"]
        pod["serviceAccountName"] = account.metadata.name
        for volume in pod["volumes"]:
            if "configMap" in volume:
                volume["configMap"]["name"] = config_map.metadata.name
            if "secret" in volume:
                volume["secret"]["secretName"] = cert.metadata.name
        (container,) = pod["containers"]
        self.version = container["image"].split("@", 1)[0].rsplit(":", 1)[1]
        # After its CRDs, its rights and its webhook configurations: it reports ready once it has put its CA
        # into them, so what their webhooks intercept may be created from then on.
        self.deployment = create("controller", deployment, depends_on=[*self.crds.values(), *bindings, *webhooks])
        self.ready: list[pulumi.Resource] = [self.deployment]
        self.register_outputs({"namespaces": self.namespaces, "version": self.version})


@dataclass(frozen=True)
class QueuesArgs:
    pools: Sequence[Pool]
    kueue: KueueController  # its CRDs, the namespaces it queues (a LocalQueue per pool in each), its readiness
    after: Sequence[pulumi.Resource] = ()  # the queued namespaces themselves


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

        self.priority_classes = [
            custom(f"{name}-{p}", "WorkloadPriorityClass", meta(p), value=value, description=text)
            for p, (value, text) in PRIORITIES.items()
        ]
        self.local_queues = []
        self.cluster_queues = []
        for pool in args.pools:
            flavor = custom(
                f"{name}-{pool.name}-flavor",
                "ResourceFlavor",
                meta(pool.name),
                spec={"nodeLabels": {ACCELERATOR_LABEL: pool.accelerator}},
            )
            cq = custom(
                f"{name}-{pool.name}",
                "ClusterQueue",
                meta(pool.name),
                after=[flavor],
                spec=cluster_queue_spec(pool, kueue.namespaces),
            )
            self.cluster_queues.append(cq)
            for ns in kueue.namespaces:
                self.local_queues.append(
                    custom(
                        f"{name}-{ns}-{pool.name}",
                        "LocalQueue",
                        meta(queue_name(pool.accelerator), ns),
                        after=[cq, *args.after],
                        spec={"clusterQueue": pool.name},
                    )
                )
        # What a queued job waits for: its LocalQueue and the priority classes it names.
        self.ready: list[pulumi.Resource] = [*self.local_queues, *self.priority_classes]
        self.register_outputs({"cluster_queues": [p.name for p in args.pools]})
