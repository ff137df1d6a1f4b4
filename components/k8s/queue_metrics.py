"""Kueue seen from outside its controller (issue 36, item 5): its metrics Service, the reader role the
CloudWatch agent's Prometheus scrape is bound to, the visibility APIService (pending workloads and
their positions) and the NetworkPolicy around the controller's ports, the pinned objects of
components/addons/kueue-observability.yaml.

The controller (components/k8s/queues.py, components/addons/kueue.yaml) serves both: metrics on its
https port 8443 behind the API server's authentication and authorisation, the visibility API on 8082
(VisibilityOnDemand). What the scrape does with the metrics (the `kueue` job, keeping the `metrics`
port, the agent's token) is components/k8s/operations.py; the alarms and dashboard that read them are
components/aws/monitoring.py.

The CloudWatch agent drops histograms, Kueue's admission wait among them, so this component also runs
the queue-wait relay (supernode.trainer.queue_wait, from the trainer image) in the Kueue namespace: it
reads Kueue's metrics with its own token (bound to the same reader role) and exports each ClusterQueue's
wait p95 over the alarm's window, and the age of its oldest pending workload at training priority or above
(the visibility API), as gauges, which the agent scrapes (the `supernode-queue-wait` job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from supernode.core.observability import KUEUE_METRICS_READER, PROMETHEUS_AGENT, QUEUE_WAIT_SCRAPE_JOB

from .addons import addon_resource, load_addon_objects
from .common import meta
from .queues import CONTROLLER_NAMESPACE, PRIORITIES, TRAINING, KueueController

OBSERVABILITY_FILE = "kueue-observability.yaml"
CONTROLLER_ACCOUNT = "kueue-controller-manager"  # the controller's service account (kueue.yaml)
METRICS_SERVICE, METRICS_PORT = "kueue-controller-manager-metrics-service", 8443
RELAY = QUEUE_WAIT_SCRAPE_JOB  # the relay's Deployment, service account and pod label: supernode-queue-wait
RELAY_PORT = 9400
RELAY_INTERVAL_S = 30  # two reads a scrape minute: one of Kueue's two replicas (the leader) answers each
PENDING_VIEWER = "kueue-pending-workloads-cq-viewer"  # the relay reads each ClusterQueue's pending workloads
# The oldest-pending gauge counts work at training priority or above: experiments (and the scheduled fabric
# check) wait for free nodes by design.
MIN_PRIORITY = PRIORITIES[TRAINING][0]


@dataclass(frozen=True)
class QueueMetricsArgs:
    kueue: KueueController  # its namespace (the namespaced objects go there) and its readiness
    image: str  # the trainer image: the relay is supernode.trainer.queue_wait
    window_s: int  # the relay's window: the queue-wait alarm's (monitoring.queueWaitP95Minutes)


def relay_container(image: str, source: pulumi.Input[str], window_s: int) -> dict[str, Any]:
    """`supernode.trainer.queue_wait watch` on Kueue's metrics `source`, serving its gauges on RELAY_PORT."""
    return {
        "name": RELAY,
        "image": image,
        "command": ["python", "-m", "supernode.trainer.queue_wait", "watch"],
        "args": [
            "--source",
            source,
            "--window-s",
            str(window_s),
            "--interval-s",
            str(RELAY_INTERVAL_S),
            "--port",
            str(RELAY_PORT),
            "--min-priority",
            str(MIN_PRIORITY),
        ],
        "ports": [{"name": "metrics", "containerPort": RELAY_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,  # the image's USER 10001
            "capabilities": {"drop": ["ALL"]},
        },
    }


class QueueMetrics(pulumi.ComponentResource):
    """`metrics_service` and `visibility_service` in the controller's namespace; `api_service` (after
    the controller is ready, so the aggregator finds a server behind it)."""

    def __init__(self, name: str, args: QueueMetricsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:workload:QueueMetrics", name, None, opts)
        kueue = args.kueue
        ns = kueue.namespace.metadata.name
        created: dict[tuple[str, str], pulumi.CustomResource] = {}

        def create(obj: dict[str, Any], **options: Any) -> pulumi.CustomResource:
            md = obj["metadata"]
            namespace = ns if md.get("namespace") == CONTROLLER_NAMESPACE else None
            resource = addon_resource(
                f"{name}-{obj['kind'].lower()}-{md['name']}",
                obj,
                pulumi.ResourceOptions(parent=self, **options),
                namespace,
            )
            created[obj["kind"], md["name"]] = resource
            return resource

        objs = load_addon_objects(OBSERVABILITY_FILE)
        for obj in objs:
            kind = obj["kind"]
            if kind == "ClusterRoleBinding":
                ref = obj["roleRef"]
                ref["name"] = created["ClusterRole", ref["name"]].metadata.name
                for subject in obj["subjects"]:
                    if subject["namespace"] == CONTROLLER_NAMESPACE:  # the relay's account, created below
                        assert subject["name"] == RELAY, subject
                        subject["namespace"] = ns
                    else:  # the agent's, as the scrape runs it (operations.py renames the file's to this)
                        assert (subject["namespace"], subject["name"]) == PROMETHEUS_AGENT, subject
            elif kind == "RoleBinding":  # in kube-system: the controller's account reads the auth config
                for subject in obj["subjects"]:
                    assert subject["name"] == CONTROLLER_ACCOUNT
                    subject["namespace"] = ns
            elif kind == "APIService":
                service = obj["spec"]["service"]
                svc = created["Service", service["name"]]
                service.update(name=svc.metadata.name, namespace=ns)
                self.api_service = create(obj, depends_on=kueue.ready)
                continue
            create(obj)
        self.metrics_service = created["Service", METRICS_SERVICE]
        self.visibility_service = created["Service", "kueue-visibility-server"]
        self.relay = self._relay(
            name,
            args,
            ns,
            [created["ClusterRoleBinding", KUEUE_METRICS_READER], created["ClusterRoleBinding", PENDING_VIEWER]],
        )
        self.register_outputs({})

    def _relay(
        self, name: str, args: QueueMetricsArgs, ns: pulumi.Input[str], bindings: list[pulumi.Resource]
    ) -> k8s.apps.v1.Deployment:
        """One replica (two would export the same gauges twice), after its right to read the metrics."""
        labels = {"app.kubernetes.io/name": RELAY}
        sa = k8s.core.v1.ServiceAccount(
            f"{name}-relay", metadata=meta(RELAY, ns, labels), opts=pulumi.ResourceOptions(parent=self)
        )
        svc = self.metrics_service.metadata
        source = pulumi.Output.concat("https://", svc.name, ".", svc.namespace, f".svc:{METRICS_PORT}/metrics")
        return k8s.apps.v1.Deployment(
            f"{name}-relay",
            metadata=meta(RELAY, ns, labels),
            spec={
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": sa.metadata.name,
                        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                        "containers": [relay_container(args.image, source, args.window_s)],
                    },
                },
            },
            opts=pulumi.ResourceOptions(parent=self, depends_on=bindings),
        )
