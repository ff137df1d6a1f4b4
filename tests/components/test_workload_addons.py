"""Third-party add-ons come from pinned YAML files in components/addons/ and are patched per stack."""

from __future__ import annotations

import yaml
from test_workload import objects, stack_preview

from supernode.components.k8s.addons import (
    DRA_DRIVER,
    DRA_DRIVER_FILE,
    addon_images,
    load_addon_objects,
    regional_image,
)
from supernode.components.k8s.common import ADDON_DIR, PART_OF, GpuNodes
from supernode.components.taints import Taint

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}


def test_addon_files_pin_every_image() -> None:
    files = sorted(ADDON_DIR.glob("*.yaml"))
    assert {f.name for f in files} >= {
        "nvidia-device-plugin.yaml",
        "aws-efa-k8s-device-plugin.yaml",
        "dcgm-exporter.yaml",
        "training-operator.yaml",
        "nvidia-dra-driver.yaml",
    }
    pods = [
        obj.get("spec", {}).get("template", {}).get("spec", {})
        for f in files
        for obj in yaml.safe_load_all(f.read_text())
        if obj
    ]
    images = [c["image"] for pod in pods for c in pod.get("initContainers", []) + pod.get("containers", [])]
    assert set(images) == set(addon_images().values())  # each one a stack may pin by digest (images.addons)
    for image in images:
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest", image


def test_addons_are_patched_for_the_stack() -> None:
    cfg, result = stack_preview("prod")
    objs = objects(result)
    efa = objs[("DaemonSet", "aws-efa-k8s-device-plugin")]
    (c,) = efa["spec"]["template"]["spec"]["containers"]
    # the file names AWS's us-west-2 registry; the stack pulls from its own region
    assert f".dkr.ecr.{cfg.region}.amazonaws.com/" in c["image"]
    for name in ("nvidia-device-plugin", "aws-efa-k8s-device-plugin", "dcgm-exporter"):
        ds = objs[("DaemonSet", name)]
        pod = ds["spec"]["template"]["spec"]
        assert pod["tolerations"][0] == GPU_TOLERATION  # the GPU node groups' taints come first
        (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {"key": "supernode.io/node-group", "operator": "In", "values": ["gpu-a", "gpu-b"]} in term[
            "matchExpressions"
        ]
        assert PART_OF.items() <= ds["metadata"]["labels"].items()
    assert objs[("DaemonSet", "dcgm-exporter")]["metadata"]["namespace"] == "supernode-system"
    webhook = objs[("ValidatingWebhookConfiguration", "validator.training-operator.kubeflow.org")]
    assert webhook["webhooks"][0]["clientConfig"]["service"] == {
        "name": "training-operator",
        "namespace": "supernode-system",
        "path": "/validate-kubeflow-org-v1-pytorchjob",
    }


def test_regional_image_rewrites_only_the_ecr_region() -> None:
    image = "602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/aws-efa-k8s-device-plugin:v0.5.6"
    assert regional_image(image, "eu-north-1") == image.replace("us-west-2", "eu-north-1")
    assert (
        regional_image("nvcr.io/nvidia/k8s-device-plugin:v0.17.0", "eu-north-1")
        == "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"
    )


def test_one_taint_type_from_node_groups_to_tolerations() -> None:
    gpu = Taint("nvidia.com/gpu", "true")
    nodes = GpuNodes.for_groups(
        {"a": {"k": "1"}, "b": {"k": "2"}},
        {"a": [gpu, Taint("z", "1", "NoExecute")], "b": [Taint("nvidia.com/gpu", "true")]},
    )
    assert nodes.taints == [gpu, Taint("z", "1", "NoExecute")]  # deduplicated across groups, sorted
    assert nodes.tolerations()[0] == GPU_TOLERATION
    assert gpu.kubelet_flag() == "nvidia.com/gpu=true:NoSchedule"


def test_the_dra_driver_is_one_pinned_image_in_compute_domain_mode_only() -> None:
    objs = load_addon_objects(DRA_DRIVER_FILE)
    pods = {o["kind"]: o["spec"]["template"]["spec"] for o in objs if o["kind"] in ("Deployment", "DaemonSet")}
    containers = [c for pod in pods.values() for c in pod.get("initContainers", []) + pod["containers"]]
    assert {c["image"] for c in containers} == {addon_images()[DRA_DRIVER]}
    # ComputeDomains only (the chart's resources.gpus.enabled=false): no gpus kubelet plugin
    assert [c["name"] for c in pods["DaemonSet"]["containers"]] == ["compute-domains"]
    assert [c["name"] for c in pods["Deployment"]["containers"]] == ["compute-domain"]
    # least privilege: nothing but what the driver reads and writes, and no wildcards
    rules = [r for o in objs if o["kind"] in ("ClusterRole", "Role") for r in o["rules"]]
    assert all("*" not in r["verbs"] + r["resources"] + r["apiGroups"] for r in rules)
    assert {g for r in rules for g in r["apiGroups"]} == {"", "apps", "resource.k8s.io", "resource.nvidia.com"}


def test_the_dra_driver_only_where_the_nvlink_domain_spans_nodes() -> None:
    _, result = stack_preview("prod")
    assert not [key for key in objects(result) if key[0] == "DeviceClass" or "dra-driver" in key[1]]
