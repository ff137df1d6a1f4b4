"""Kueue seen from outside its controller (issue 36, item 5): its metrics Service, the reader role the
CloudWatch agent's Prometheus scrape is bound to, the visibility APIService (pending workloads and
their positions) and the NetworkPolicy around the controller's ports, the pinned objects of
components/addons/kueue-observability.yaml.

The controller (components/k8s/queues.py, components/addons/kueue.yaml) serves both: metrics on its
https port 8443 behind the API server's authentication and authorisation, the visibility API on 8082
(VisibilityOnDemand). What the scrape does with the metrics (the `kueue` job, keeping the `metrics`
port, the agent's token) is components/k8s/operations.py; the alarms and dashboard that read them are
components/aws/monitoring.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi

from supernode.core.observability import KUEUE_METRICS_READER, PROMETHEUS_AGENT

from .addons import addon_resource, load_addon_objects
from .queues import CONTROLLER_NAMESPACE, KueueController

OBSERVABILITY_FILE = "kueue-observability.yaml"
CONTROLLER_ACCOUNT = "kueue-controller-manager"  # the controller's service account (kueue.yaml)


@dataclass(frozen=True)
class QueueMetricsArgs:
    kueue: KueueController  # its namespace (the namespaced objects go there) and its readiness


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
                [subject] = obj["subjects"]
                # the agent's account, as the scrape runs it (operations.py renames the file's to this)
                assert (subject["namespace"], subject["name"]) == PROMETHEUS_AGENT, subject
                assert obj["metadata"]["name"] == KUEUE_METRICS_READER
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
        self.metrics_service = created["Service", "kueue-controller-manager-metrics-service"]
        self.visibility_service = created["Service", "kueue-visibility-server"]
        self.register_outputs({})
