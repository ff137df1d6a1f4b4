"""Cluster add-ons the training job needs, as explicit objects (so `supernode preview --manifests`
can render and validate them offline, which Helm releases cannot): the NVIDIA and EFA device
plugins, the DCGM exporter with a Prometheus scrape endpoint, and the Kubeflow training operator
(PyTorchJob only). The FSx CSI driver is an EKS add-on on the AWS side, so it is not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pulumi
import pulumi_kubernetes as k8s

from supernode.core.catalog import CATALOG

from .workload_common import GpuNodes, PART_OF, load_crd, meta

# Pinned add-on versions (by tag: digests cannot be resolved offline; pin them when mirroring to ECR).
VERSIONS = {
    "nvidia-device-plugin": "v0.17.0",
    "aws-efa-k8s-device-plugin": "v0.5.6",
    "dcgm-exporter": "3.3.9-3.6.1-ubuntu22.04",
    "training-operator": "v1.8.1",
}
EKS_ECR_ACCOUNT = "602401143452"  # AWS's registry for EKS add-on images in commercial regions
DCGM_PORT = 9400
SYSTEM_NAMESPACE = "supernode-system"
OPERATOR = "training-operator"
WEBHOOK_CERT_DIR = "/tmp/k8s-webhook-server/serving-certs"


@dataclass(frozen=True)
class AddonArgs:
    region: str
    gpu_nodes: GpuNodes


def _hostpath_volume(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": path}}


def _efa_instance_types() -> list[str]:
    """Nodes the EFA plugin runs on: every catalog type with EFA devices (so a new type is one catalog line)."""
    return sorted(name for name, t in CATALOG.items() if t.efa_interfaces > 0)


class ClusterAddons(pulumi.ComponentResource):
    """Device plugins, GPU metrics and the training operator. `ready` lists what a job must wait for."""

    def __init__(self, name: str, args: AddonArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("supernode:workload:ClusterAddons", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        gpu = args.gpu_nodes
        device_plugin_dir = _hostpath_volume("device-plugin", "/var/lib/kubelet/device-plugins")
        locked_down = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}

        self.namespace = k8s.core.v1.Namespace(f"{name}-ns", metadata=meta(SYSTEM_NAMESPACE), opts=child)
        ns = self.namespace.metadata.name

        nvidia_labels = {"app.kubernetes.io/name": "nvidia-device-plugin"}
        self.nvidia_device_plugin = k8s.apps.v1.DaemonSet(f"{name}-nvidia-device-plugin", metadata=meta(
            "nvidia-device-plugin", "kube-system", nvidia_labels), spec={
            "selector": {"matchLabels": nvidia_labels},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": nvidia_labels}, "spec": {
                "priorityClassName": "system-node-critical",
                "tolerations": gpu.tolerations(),
                "affinity": gpu.affinity(),
                "containers": [{
                    "name": "nvidia-device-plugin",
                    "image": f"nvcr.io/nvidia/k8s-device-plugin:{VERSIONS['nvidia-device-plugin']}",
                    "env": [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}],
                    "securityContext": locked_down,
                    "volumeMounts": [{"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"}],
                }],
                "volumes": [device_plugin_dir],
            }},
        }, opts=child)

        efa_labels = {"app.kubernetes.io/name": "aws-efa-k8s-device-plugin"}
        efa_nodes = {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": _efa_instance_types()}
        self.efa_device_plugin = k8s.apps.v1.DaemonSet(f"{name}-efa-device-plugin", metadata=meta(
            "aws-efa-k8s-device-plugin", "kube-system", efa_labels), spec={
            "selector": {"matchLabels": efa_labels},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": efa_labels}, "spec": {
                "priorityClassName": "system-node-critical",
                "hostNetwork": True,
                "tolerations": gpu.tolerations() + [
                    {"key": "CriticalAddonsOnly", "operator": "Exists"},
                    {"key": "aws.amazon.com/efa", "operator": "Exists", "effect": "NoSchedule"}],
                "affinity": gpu.affinity(extra=[efa_nodes]),
                "containers": [{
                    "name": "aws-efa-k8s-device-plugin",
                    "image": f"{EKS_ECR_ACCOUNT}.dkr.ecr.{args.region}.amazonaws.com/eks/aws-efa-k8s-device-plugin:"
                             f"{VERSIONS['aws-efa-k8s-device-plugin']}",
                    "securityContext": locked_down,
                    "volumeMounts": [{"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"},
                                     {"name": "infiniband", "mountPath": "/dev/infiniband"}],
                }],
                "volumes": [device_plugin_dir, _hostpath_volume("infiniband", "/dev/infiniband")],
            }},
        }, opts=child)

        # DCGM exporter: per-GPU metrics (utilisation, memory, XID errors) attributed to pods through
        # the kubelet's pod-resources socket; the pods and the Service carry the Prometheus scrape
        # annotations that the CloudWatch agent / Prometheus discovery of the monitoring stack uses.
        # Default counters only: profiling (DCP) metrics need SYS_ADMIN and admit one collector per
        # GPU, and the CloudWatch observability add-on may run its own exporter on the same nodes.
        dcgm_labels = {"app.kubernetes.io/name": "dcgm-exporter"}
        self.scrape_annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(DCGM_PORT),
                                   "prometheus.io/path": "/metrics"}
        self.dcgm_exporter = k8s.apps.v1.DaemonSet(f"{name}-dcgm-exporter", metadata=meta(
            "dcgm-exporter", ns, dcgm_labels), spec={
            "selector": {"matchLabels": dcgm_labels},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": dcgm_labels, "annotations": self.scrape_annotations}, "spec": {
                "priorityClassName": "system-node-critical",
                "tolerations": gpu.tolerations(),
                "affinity": gpu.affinity(),
                "containers": [{
                    "name": "dcgm-exporter",
                    "image": f"nvcr.io/nvidia/k8s/dcgm-exporter:{VERSIONS['dcgm-exporter']}",
                    "env": [{"name": "DCGM_EXPORTER_KUBERNETES", "value": "true"},
                            {"name": "DCGM_EXPORTER_LISTEN", "value": f":{DCGM_PORT}"}],
                    "ports": [{"name": "metrics", "containerPort": DCGM_PORT}],
                    "securityContext": {"runAsUser": 0, "allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}},
                    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                    "readinessProbe": {"httpGet": {"path": "/health", "port": DCGM_PORT}},
                    "volumeMounts": [{"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources",
                                      "readOnly": True}],
                }],
                "volumes": [_hostpath_volume("pod-resources", "/var/lib/kubelet/pod-resources")],
            }},
        }, opts=child)
        self.dcgm_service = k8s.core.v1.Service(f"{name}-dcgm-exporter", metadata=meta(
            "dcgm-exporter", ns, dcgm_labels, self.scrape_annotations), spec={
            "selector": dcgm_labels,
            "ports": [{"name": "metrics", "port": DCGM_PORT, "targetPort": "metrics"}],
        }, opts=child)
        self.dcgm_endpoint = pulumi.Output.concat("http://dcgm-exporter.", ns, f".svc:{DCGM_PORT}/metrics")

        self._training_operator(name, ns, child)
        self.ready = [self.pytorchjob_crd, self.operator]
        self.register_outputs({"versions": VERSIONS, "dcgm_endpoint": self.dcgm_endpoint,
                               "scrape_annotations": self.scrape_annotations})

    def _training_operator(self, name: str, ns: pulumi.Output[str], child: pulumi.ResourceOptions) -> None:
        """Kubeflow training operator limited to PyTorchJob: CRD, RBAC, validating webhook, Deployment."""
        crd = load_crd("pytorchjob.yaml")
        crd["metadata"]["labels"] = dict(PART_OF)
        self.pytorchjob_crd = k8s.apiextensions.v1.CustomResourceDefinition(
            f"{name}-pytorchjob-crd", metadata=crd["metadata"], spec=crd["spec"], opts=child)

        labels = {"app.kubernetes.io/name": OPERATOR}
        sa = k8s.core.v1.ServiceAccount(f"{name}-{OPERATOR}", metadata=meta(OPERATOR, ns, labels), opts=child)
        rules = [
            {"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs", "pytorchjobs/status", "pytorchjobs/finalizers"],
             "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
            {"apiGroups": [""], "resources": ["pods", "services", "events"],
             "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
            {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"],
             "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
            {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["validatingwebhookconfigurations"],
             "verbs": ["get", "list", "watch", "update"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
             "verbs": ["get", "list", "watch", "create", "update"]},
        ]
        role = k8s.rbac.v1.ClusterRole(f"{name}-{OPERATOR}", metadata=meta(OPERATOR, labels=labels), rules=rules,
                                       opts=child)
        k8s.rbac.v1.ClusterRoleBinding(f"{name}-{OPERATOR}", metadata=meta(OPERATOR, labels=labels),
                                       role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                 "name": role.metadata.name},
                                       subjects=[{"kind": "ServiceAccount", "name": sa.metadata.name,
                                                  "namespace": ns}], opts=child)
        # The webhook certificate is generated and rotated by the operator into this Secret (and the
        # caBundle into the webhook configuration), so Pulumi must not fight over those fields.
        cert = k8s.core.v1.Secret(f"{name}-{OPERATOR}-webhook-cert", metadata=meta(
            f"{OPERATOR}-webhook-cert", ns, labels), type="Opaque",
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(ignore_changes=["data"])))
        # Secrets only in its own namespace (the certificate), not cluster-wide.
        cert_role = k8s.rbac.v1.Role(f"{name}-{OPERATOR}-cert", metadata=meta(f"{OPERATOR}-cert", ns, labels), rules=[
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "watch", "update"]}], opts=child)
        k8s.rbac.v1.RoleBinding(f"{name}-{OPERATOR}-cert", metadata=meta(f"{OPERATOR}-cert", ns, labels),
                                role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                          "name": cert_role.metadata.name},
                                subjects=[{"kind": "ServiceAccount", "name": sa.metadata.name, "namespace": ns}],
                                opts=child)
        svc = k8s.core.v1.Service(f"{name}-{OPERATOR}", metadata=meta(OPERATOR, ns, labels), spec={
            "selector": labels,
            "ports": [{"name": "monitoring-port", "port": 8080, "targetPort": 8080},
                      {"name": "webhook-server", "port": 443, "targetPort": 9443}],
        }, opts=child)
        k8s.admissionregistration.v1.ValidatingWebhookConfiguration(
            f"{name}-{OPERATOR}-webhook", metadata=meta("validator.training-operator.kubeflow.org", labels=labels),
            webhooks=[{
                "name": "validator.pytorchjob.training-operator.kubeflow.org",
                "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
                "clientConfig": {"service": {"name": svc.metadata.name, "namespace": ns,
                                             "path": "/validate-kubeflow-org-v1-pytorchjob"}},
                "rules": [{"apiGroups": ["kubeflow.org"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                           "resources": ["pytorchjobs"]}],
            }],
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(
                ignore_changes=["webhooks[*].clientConfig.caBundle"])))
        self.operator = k8s.apps.v1.Deployment(f"{name}-{OPERATOR}", metadata=meta(OPERATOR, ns, labels), spec={
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "serviceAccountName": sa.metadata.name,
                "containers": [{
                    "name": OPERATOR,
                    "image": f"kubeflow/training-operator:{VERSIONS['training-operator']}",
                    "command": ["/manager"],
                    "args": ["--enable-scheme=pytorchjob"],
                    "env": [{"name": "MY_POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                            {"name": "MY_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                    "ports": [{"name": "metrics", "containerPort": 8080},
                              {"name": "webhook-server", "containerPort": 9443}],
                    "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8081}, "initialDelaySeconds": 15},
                    "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8081}, "initialDelaySeconds": 10},
                    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                    "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                        "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "cert", "mountPath": WEBHOOK_CERT_DIR, "readOnly": True}],
                }],
                "volumes": [{"name": "cert", "secret": {"secretName": cert.metadata.name}}],
            }},
        }, opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=[self.pytorchjob_crd])))
