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

from .addons import addon_resource, with_config_hash, with_images
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
            create("leader-election", bind(objs["RoleBinding"], create("leader-election", objs["Role"]))),
        ]
        # The controller writes and rotates the certificate in this Secret and injects its CA into both
        # webhook configurations: Pulumi must not fight over either. Their names are the controller's own.
        cert = create("webhook-cert", objs["Secret"], ignore_changes=["data"])
        service = create("webhook", objs["Service"])
        config = objs["ConfigMap"]["data"][CONFIG_KEY]
        config_map = create("config", objs["ConfigMap"])
        webhooks = []
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            for hook in objs[kind]["webhooks"]:
                hook["clientConfig"]["service"].update(name=service.metadata.name, namespace=ns)
                if _intercepts_pods(hook):  # fails closed: only where LeaderWorkerSets run
                    hook["namespaceSelector"] = {
                        "matchExpressions": [
                            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(pod_namespaces)}
                        ]
                    }
            webhooks.append(
                create(
                    kind.removesuffix("Configuration").lower(),
                    objs[kind],
                    ignore_changes=["webhooks[*].clientConfig.caBundle"],
                )
            )
        deployment = with_config_hash(with_images(objs["Deployment"], images), config)
        pod = deployment["spec"]["template"]["spec"]
        pod["serviceAccountName"] = account.metadata.name
        for volume in pod["volumes"]:
            if "configMap" in volume:
                volume["configMap"]["name"] = config_map.metadata.name
            if "secret" in volume:
                volume["secret"]["secretName"] = cert.metadata.name
        (container,) = pod["containers"]
        self.version = container["image"].split("@", 1)[0].rsplit(":", 1)[1]
        self.deployment = create("controller", deployment, depends_on=[self.crd, *bindings, *webhooks])
        self.ready: list[pulumi.Resource] = [self.crd, self.deployment]
        self.register_outputs({"version": self.version})
