"""Shared pieces of the Kubernetes workload components: labels, GPU node selection, the pod's
resources, the CRD and add-on files."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from supernode.core.capacity import PodShape

from ..taints import NODE_HEALTH_KEYS, Taint

CRD_DIR = Path(__file__).resolve().parents[1] / "crds"
ADDON_DIR = Path(__file__).resolve().parents[1] / "addons"
PART_OF = {"app.kubernetes.io/part-of": "supernode", "app.kubernetes.io/managed-by": "pulumi"}
# Pods of one distributed job carry this label; the mesh NetworkPolicy admits exactly these peers.
MESH_LABEL = "supernode.io/fabric-mesh"


@dataclass(frozen=True)
class GpuNodes:
    """How GPU nodes are told apart: node labels (each key with its allowed values) and the taints
    they carry, both set by the AWS node groups."""

    selector: Mapping[str, Sequence[str]]
    taints: Sequence[Taint]

    @classmethod
    def for_groups(cls, labels: Mapping[str, Mapping[str, str]], taints: Mapping[str, Sequence[Taint]]) -> GpuNodes:
        """From per-group labels and taints: the label keys every group has (with any group's value),
        and every group's taints, so a pod may land on a node of any of the groups."""
        groups = list(labels.values())
        common = set.intersection(*(set(g) for g in groups)) if groups else set()
        selector = {k: sorted({g[k] for g in groups}) for k in sorted(common)}
        unique = {t for group_taints in taints.values() for t in group_taints}
        return cls(selector=selector, taints=sorted(unique))

    def tolerations(self) -> list[dict[str, str]]:
        """A workload pod's: the node groups' taints, except the node-health ones (no unchecked or
        quarantined node takes training or serving)."""
        return [t.toleration() for t in self.taints if t.key not in NODE_HEALTH_KEYS]

    def daemon_tolerations(self) -> list[dict[str, str]]:
        """A DaemonSet's on the GPU nodes: it runs on unchecked and quarantined nodes too (the deep check
        needs the device plugin and DCGM; the agent releases the node)."""
        return self.tolerations() + [{"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in NODE_HEALTH_KEYS]

    def affinity(self, extra: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
        """Required node affinity to the GPU node labels, plus `extra` match expressions."""
        exprs = [{"key": k, "operator": "In", "values": list(v)} for k, v in sorted(self.selector.items())]
        return {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": exprs + list(extra)}]
                }
            }
        }


def meta(
    name: str,
    namespace: pulumi.Input[str] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, pulumi.Input[str]] | None = None,
) -> dict[str, Any]:
    """Object metadata with explicit names: the offline manifests must not depend on auto-naming."""
    m: dict[str, Any] = {"name": name, "labels": {**PART_OF, **(labels or {})}}
    if namespace is not None:
        m["namespace"] = namespace
    if annotations:
        m["annotations"] = dict(annotations)
    return m


def pod_security_namespace(
    resource: str, name: str, enforce: str, warn: str, opts: pulumi.ResourceOptions
) -> k8s.core.v1.Namespace:
    """A namespace whose pods Pod Security admission holds to `enforce` (and warns above `warn`)."""
    return k8s.core.v1.Namespace(
        resource,
        metadata=meta(
            name,
            labels={"pod-security.kubernetes.io/enforce": enforce, "pod-security.kubernetes.io/warn": warn},
        ),
        opts=opts,
    )


def irsa(role_arn: pulumi.Input[str]) -> dict[str, pulumi.Input[str]]:
    """A service account's annotations for its IAM role (IRSA), through the regional STS endpoint."""
    return {"eks.amazonaws.com/role-arn": role_arn, "eks.amazonaws.com/sts-regional-endpoints": "true"}


def bound_role(
    resource: str,
    name: str,
    namespace: pulumi.Input[str] | None,
    rules: list[dict[str, Any]],
    subjects: list[dict[str, Any]],
    opts: pulumi.ResourceOptions,
) -> tuple[pulumi.CustomResource, pulumi.CustomResource]:
    """A Role and the RoleBinding that grants it to `subjects`, both named `name` (Pulumi resource names
    `resource`); namespace None: a ClusterRole and its ClusterRoleBinding. Returns (role, binding): what
    needs the permission depends on the binding."""
    if namespace is None:
        role = k8s.rbac.v1.ClusterRole(resource, metadata=meta(name), rules=rules, opts=opts)
        binding = k8s.rbac.v1.ClusterRoleBinding(
            resource,
            metadata=meta(name),
            role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role.metadata.name},
            subjects=subjects,
            opts=opts,
        )
        return role, binding
    role = k8s.rbac.v1.Role(resource, metadata=meta(name, namespace), rules=rules, opts=opts)
    binding = k8s.rbac.v1.RoleBinding(
        resource,
        metadata=meta(name, namespace),
        role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role.metadata.name},
        subjects=subjects,
        opts=opts,
    )
    return role, binding


def cron_job(
    resource: str,
    name: str,
    namespace: pulumi.Input[str],
    schedule: str,
    job_template: dict[str, Any],
    opts: pulumi.ResourceOptions,
) -> k8s.batch.v1.CronJob:
    """A CronJob named `name` (Pulumi resource name `resource`) that never starts a run while the last
    one still runs (concurrencyPolicy Forbid) and keeps the last three succeeded and failed Jobs to read."""
    return k8s.batch.v1.CronJob(
        resource,
        metadata=meta(name, namespace),
        spec={
            "schedule": schedule,
            "concurrencyPolicy": "Forbid",
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": job_template,
        },
        opts=opts,
    )


def dns_name(*parts: str) -> str:
    """A Kubernetes object name (RFC 1123 label) from free-form parts such as a Pulumi stack name."""
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    return name[:63].rstrip("-")


def load_crd(filename: str) -> dict[str, Any]:
    return yaml.safe_load((CRD_DIR / filename).read_text(encoding="utf-8"))


def crd_kind(filename: str) -> str:
    return load_crd(filename)["spec"]["names"]["kind"]


def shipped_crd(
    resource_name: str, filename: str, opts: pulumi.ResourceOptions
) -> k8s.apiextensions.v1.CustomResourceDefinition:
    """A CRD shipped in components/crds/, labelled as part of the stack."""
    crd = load_crd(filename)
    crd["metadata"]["labels"] = {**crd["metadata"].get("labels", {}), **PART_OF}
    return k8s.apiextensions.v1.CustomResourceDefinition(
        resource_name, metadata=crd["metadata"], spec=crd["spec"], opts=opts
    )


def load_addon(filename: str) -> dict[str, dict[str, Any]]:
    """The objects of one pinned add-on file, by kind (one object per kind and file), freshly parsed
    so the caller may patch them in place."""
    objects: dict[str, dict[str, Any]] = {}
    for obj in yaml.safe_load_all((ADDON_DIR / filename).read_text(encoding="utf-8")):
        if obj is None:
            continue
        if obj["kind"] in objects:
            raise ValueError(f"{filename}: more than one {obj['kind']}")
        objects[obj["kind"]] = obj
    return objects


def gib(n: float) -> str:
    return f"{int(n)}Gi"


def pod_resources(shape: PodShape) -> dict[str, Any]:
    """The container resources of the plan's pod shape: requests = limits (Guaranteed QoS, whole node)."""
    amounts: dict[str, Any] = {
        shape.device_resource: str(shape.gpus),
        "vpc.amazonaws.com/efa": str(shape.efa),
        "cpu": str(shape.cpu),
        "memory": gib(shape.memory_gib),
    }
    if shape.hugepages_gib:
        amounts["hugepages-2Mi"] = gib(shape.hugepages_gib)
    return {"requests": amounts, "limits": dict(amounts)}


def fsx_claim(
    name: str,
    fsx_id: pulumi.Input[str],
    dns_name: pulumi.Input[str],
    mount_name: pulumi.Input[str],
    namespace: str,
    claim: str,
    size: pulumi.Input[str],
    read_only: bool,
    opts: pulumi.ResourceOptions,
) -> k8s.core.v1.PersistentVolumeClaim:
    """A static FSx for Lustre volume bound to one claim in `namespace`: the file system exists (AWS
    side), the PV only points at it. The Lustre client runs in the node's kernel, so its traffic is not
    pod traffic (no network policy). Read-write volumes mount with `flock` (the trainer's out-directory
    lock); read-only ones are read-only at the CSI driver too."""
    access = "ReadOnlyMany" if read_only else "ReadWriteMany"
    csi: dict[str, Any] = {
        "driver": "fsx.csi.aws.com",
        "volumeHandle": fsx_id,
        "volumeAttributes": {"dnsname": dns_name, "mountname": mount_name},
    }
    spec: dict[str, Any] = {
        "capacity": {"storage": size},
        "volumeMode": "Filesystem",
        "accessModes": [access],
        "persistentVolumeReclaimPolicy": "Retain",
        "storageClassName": "",
        "claimRef": {"namespace": namespace, "name": claim},
        "csi": csi,
    }
    if read_only:
        csi["readOnly"] = True
    else:
        spec["mountOptions"] = ["flock"]
    volume = k8s.core.v1.PersistentVolume(f"{name}-fsx-pv", metadata=meta(f"{namespace}-fsx"), spec=spec, opts=opts)
    return k8s.core.v1.PersistentVolumeClaim(
        f"{name}-fsx-pvc",
        metadata=meta(claim, namespace),
        spec={
            "accessModes": [access],
            "storageClassName": "",
            "volumeName": volume.metadata.name,
            "resources": {"requests": {"storage": size}},
        },
        opts=opts,
    )


def namespace_selector(namespaces: Sequence[str]) -> dict[str, Any]:
    """Namespaces by name: whom a ClusterQueue serves, whose jobs a controller manages, where its webhooks act."""
    return {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(namespaces)}]
    }
