"""The LeaderWorkerSet controller (components/addons/lws.yaml, kubernetes-sigs/lws v0.7.0) and its CRD
(components/crds/leaderworkerset.yaml): what turns a serving LeaderWorkerSet (a replica wider than a
node, components/k8s/serving.py) into pods. Installed only where a replica spans nodes.

Its pod webhooks inject the group's coordinates (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX)
into the group's pods: the serving command's multi-node flags read them. Upstream's intercept every pod
of the cluster and fail closed; here they are scoped to the serving namespace, so the controller being
down blocks only serving pods. `ready`: the controller's Deployment, after its CRD, rights and webhook
configurations (it reports ready once its certificate is in place), so a LeaderWorkerSet created after
it is admitted and reconciled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pulumi

from .addons import webhook_controller
from .common import load_addon, pod_security_namespace, shipped_crd

CONTROLLER_FILE = "lws.yaml"  # its container `lws` is its images.addons entry
CRD_FILE = "leaderworkerset.yaml"
CONTROLLER_NAMESPACE = "lws-system"  # the file's namespace: the controller reads its own (service account) namespace
CONFIG_KEY = "controller_manager_config.yaml"
# The env the pod webhook sets on every container of a group's pods (upstream pkg/utils/pod).
LEADER_ADDRESS, GROUP_SIZE, WORKER_INDEX = "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"


def _intercepts_pods(hook: dict[str, Any]) -> bool:
    return any("pods" in rule["resources"] for rule in hook["rules"])


class LwsController(pulumi.ComponentResource):
    def __init__(
        self,
        name: str,
        pod_namespaces: list[str],
        images: Mapping[str, str],
        opts: pulumi.ResourceOptions | None = None,
    ):
        super().__init__("supernode:serving:LwsController", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.crd = shipped_crd(f"{name}-crd", CRD_FILE, child)
        self.namespace = pod_security_namespace(f"{name}-ns", CONTROLLER_NAMESPACE, "restricted", "restricted", child)
        objs = load_addon(CONTROLLER_FILE)
        self.deployment, self.version = webhook_controller(
            name,
            objs,
            self.namespace.metadata.name,
            child,
            role="leader-election",
            config=(CONFIG_KEY, objs["ConfigMap"]["data"][CONFIG_KEY]),
            scoped=_intercepts_pods,  # only where LeaderWorkerSets run
            namespaces=pod_namespaces,
            images=images,
            after=[self.crd],
        )
        self.ready: list[pulumi.Resource] = [self.crd, self.deployment]
        self.register_outputs({"version": self.version})
