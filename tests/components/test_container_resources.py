"""Every container the stack deploys sets CPU and memory requests and limits (issue 19, item 6):
walked over the manifests the preview writes for dev and prod, add-ons and jobs alike."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from aws_preview import preview

from supernode.tools import manifests as mf

BOUNDED = ("cpu", "memory")


def pod_specs(m: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = m.get("spec") or {}
    if m["kind"] == "Pod":
        yield spec
    elif m["kind"] == "PyTorchJob":
        for replica in spec["pytorchReplicaSpecs"].values():
            yield replica["template"]["spec"]
    elif "template" in spec:
        yield spec["template"]["spec"]


def containers(manifests: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for m in manifests:
        for pod in pod_specs(m):
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                yield f"{m['kind']}/{m['metadata']['name']}/{c['name']}", c


def unbounded(manifests: list[dict[str, Any]]) -> list[str]:
    return [
        f"{where}: {kind}.{r}"
        for where, c in containers(manifests)
        for kind in ("requests", "limits")
        for r in BOUNDED
        if not (c.get("resources") or {}).get(kind, {}).get(r)
    ]


@pytest.fixture(scope="module", params=["dev", "prod", "gb200"])
def manifests(request) -> list[dict[str, Any]]:
    return mf.from_resources(preview(request.param).result.resources)


def test_every_container_sets_cpu_and_memory_requests_and_limits(manifests):
    walked = dict(containers(manifests))
    # Not vacuous: the add-ons and both jobs are there (and on GB200 the DRA driver's containers).
    names = {w.split("/")[-1] for w in walked}
    assert {
        "nvidia-device-plugin",
        "aws-efa-k8s-device-plugin",
        "dcgm-exporter",
        "training-operator",
        "pytorch",
        "fabric",
    } <= names
    if any(m["kind"] == "ComputeDomain" for m in manifests):
        assert {"compute-domain", "compute-domains", "init-container"} <= names
    assert unbounded(manifests) == []


def test_a_container_without_limits_is_found(manifests):
    broken = copy.deepcopy(manifests)
    ds = next(m for m in broken if m["kind"] == "DaemonSet" and m["metadata"]["name"] == "nvidia-device-plugin")
    del ds["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]
    assert unbounded(broken) == ["DaemonSet/nvidia-device-plugin/nvidia-device-plugin: limits.cpu"]
