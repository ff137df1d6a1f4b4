"""Shared pieces of the Kubernetes workload components: labels, GPU node selection, the CRD file."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pulumi
import yaml

from supernode.core.catalog import InstanceType

CRD_DIR = Path(__file__).resolve().parent / "crds"
PART_OF = {"app.kubernetes.io/part-of": "supernode", "app.kubernetes.io/managed-by": "pulumi"}
# Pods of one distributed job carry this label; the mesh NetworkPolicy admits exactly these peers.
MESH_LABEL = "supernode.io/fabric-mesh"


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str = "NoSchedule"

    def toleration(self) -> dict[str, str]:
        return {"key": self.key, "operator": "Equal", "value": self.value, "effect": self.effect}


@dataclass(frozen=True)
class GpuNodes:
    """How GPU nodes are told apart: node labels (each key with its allowed values) and the taints
    they carry, both set by the AWS node groups."""

    selector: Mapping[str, Sequence[str]]
    taints: Sequence[Taint]

    @classmethod
    def for_groups(cls, labels: Mapping[str, Mapping[str, str]], taints: Mapping[str, Sequence[Mapping[str, str]]]) -> "GpuNodes":
        """From per-group labels and taints: the label keys every group has (with any group's value),
        and every group's taints, so a pod may land on a node of any of the groups."""
        groups = list(labels.values())
        common = set.intersection(*(set(g) for g in groups)) if groups else set()
        selector = {k: sorted({g[k] for g in groups}) for k in sorted(common)}
        unique = {Taint(**t) for group_taints in taints.values() for t in group_taints}
        return cls(selector=selector, taints=sorted(unique, key=lambda t: (t.key, t.value, t.effect)))

    def tolerations(self) -> list[dict[str, str]]:
        return [t.toleration() for t in self.taints]

    def affinity(self, extra: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
        """Required node affinity to the GPU node labels, plus `extra` match expressions."""
        exprs = [{"key": k, "operator": "In", "values": list(v)} for k, v in sorted(self.selector.items())]
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": exprs + list(extra)}]}}}


def meta(name: str, namespace: Optional[pulumi.Input[str]] = None, labels: Optional[Mapping[str, str]] = None,
         annotations: Optional[Mapping[str, pulumi.Input[str]]] = None) -> dict[str, Any]:
    """Object metadata with explicit names: the offline manifests must not depend on auto-naming."""
    m: dict[str, Any] = {"name": name, "labels": {**PART_OF, **(labels or {})}}
    if namespace is not None:
        m["namespace"] = namespace
    if annotations:
        m["annotations"] = dict(annotations)
    return m


def dns_name(*parts: str) -> str:
    """A Kubernetes object name (RFC 1123 label) from free-form parts such as a Pulumi stack name."""
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    return name[:63].rstrip("-")


def load_crd(filename: str) -> dict[str, Any]:
    return yaml.safe_load((CRD_DIR / filename).read_text(encoding="utf-8"))


def gib(n: float) -> str:
    return f"{int(n)}Gi"


# Share of a GPU node's vCPUs and memory left to the kubelet, system reservations and the
# DaemonSets (device plugins, DCGM, CNI, FSx CSI node); the trainer pod asks for the rest.
NODE_RESERVE_FRACTION = 0.10


@dataclass(frozen=True)
class PodShape:
    """One distributed-job pod per GPU node, owning the whole node: requests = limits (Guaranteed)."""

    gpus: int
    efa: int
    cpu: int
    memory_gib: int
    hugepages_gib: int

    @classmethod
    def for_node(cls, hw: InstanceType, hugepages_gib: int) -> "PodShape":
        keep = 1 - NODE_RESERVE_FRACTION
        return cls(gpus=hw.accelerators, efa=hw.efa_interfaces, cpu=int(hw.vcpus * keep),
                   memory_gib=int(hw.memory_gib * keep) - hugepages_gib, hugepages_gib=hugepages_gib)

    def resources(self) -> dict[str, Any]:
        amounts: dict[str, Any] = {"nvidia.com/gpu": str(self.gpus), "vpc.amazonaws.com/efa": str(self.efa),
                                   "cpu": str(self.cpu), "memory": gib(self.memory_gib)}
        if self.hugepages_gib:
            amounts["hugepages-2Mi"] = gib(self.hugepages_gib)
        return {"requests": amounts, "limits": dict(amounts)}
