"""Deployment checklist items 4-5: consistent versions and code and config ready. One AMI release and the
cluster's Kubernetes version on every accelerator group; trainer and gate images pinned by digest and the
same; the trainer job mounts the plan it runs."""

from __future__ import annotations

from pulumi_policy import EnforcementLevel

from supernode.core.config import DIGEST_RE
from supernode.core.plan import PLAN_CONFIGMAP_KEY, PLAN_MOUNT_DIR, PLAN_MOUNT_PATH
from supernode.core.resource_types import (
    EKS_CLUSTER,
)

from .base import Registry, Report
from .view import (
    Stack,
    containers,
    get,
    mounts_config_map,
    plan_config_map_name,
    pod_specs,
)

POLICIES = Registry()

ADVISORY = EnforcementLevel.ADVISORY


# -- 4. consistent versions -----------------------------------------------------------------------


@POLICIES.stack("versions-consistent", 4, "GPU node groups pin one AMI release and the cluster's Kubernetes version.")
def _versions(stack: Stack, _conf: None, report: Report) -> None:
    groups = stack.gpu_node_groups()
    if not groups:
        return
    clusters = stack.of(EKS_CLUSTER)
    k8s = clusters[0].get("version") if clusters else None
    if clusters and not k8s:
        report(
            clusters[0],
            f"{clusters[0].label} does not pin its Kubernetes version. Fix: set version "
            f"(supernode:cluster.kubernetesVersion).",
        )
    pins = {}
    for ng in groups:
        lt = stack.launch_template_of(ng)
        pin = ng.get("releaseVersion") or (lt.get("imageId") if lt else None)
        pins[ng.name] = pin
        if not pin:
            report(
                ng,
                f"{ng.label} does not pin its AMI: neither releaseVersion nor a launch-template imageId. "
                f"Fix: set releaseVersion (supernode:acceleratorNodeGroups[].amiReleaseVersion).",
            )
        release = str(ng.get("releaseVersion", default=""))
        version = ng.get("version")
        if k8s and ((version and version != k8s) or (release and not release.startswith(f"{k8s}."))):
            report(
                ng,
                f"{ng.label} runs Kubernetes {version or release} but the cluster runs {k8s}. Fix: pin the node "
                f"group's version and AMI release to {k8s} (e.g. releaseVersion {k8s}.x-YYYYMMDD).",
            )
    if len({p for p in pins.values() if p}) > 1:
        for ng in groups:
            report(
                ng,
                f"GPU node groups pin different AMI releases ({pins}); mixed drivers/NCCL break collectives. "
                f"Fix: use one amiReleaseVersion for every accelerator node group.",
            )


@POLICIES.stack("images-pinned", 4, "Trainer and gate images are pinned by digest and identical.")
def _images(stack: Stack, _conf: None, report: Report) -> None:
    workloads = stack.trainer_jobs() + stack.gates()
    images = {}
    for w in workloads:
        for c in containers(w):
            image = str(get(c, "image", default=""))
            images[w.label] = image
            if not DIGEST_RE.fullmatch(image):
                report(
                    w,
                    f"{w.label} container '{get(c, 'name')}' uses image {image!r}, not pinned by digest, so the "
                    f"code that runs is not the code reviewed. Fix: use REPOSITORY@sha256:<digest> (supernode:images).",
                )
    if stack.trainer_jobs() and stack.gates() and len(set(images.values())) > 1:
        for w in workloads:
            report(
                w,
                f"the trainer and the interconnect gate run different images ({images}); the gate must test "
                f"the NCCL/EFA stack the trainer uses. Fix: run the gate from the trainer image "
                f"(leave supernode:images.fabricCheck unset).",
            )


# -- 5. code and config ready ---------------------------------------------------------------------


@POLICIES.stack(
    "code-config-ready", 5, "The trainer job mounts the plan ConfigMap (its image's digest is images-pinned's)."
)
def _code_config(stack: Stack, _conf: None, report: Report) -> None:
    cm_name = plan_config_map_name(stack)
    for job in stack.trainer_jobs():
        if cm_name is None:
            report(
                job,
                f"{job.label} has no plan to run: no ConfigMap holds data['{PLAN_CONFIGMAP_KEY}']. Fix: create the plan "  # noqa: E501
                f"ConfigMap from supernode.core.plan.Plan.to_json() and mount it at {PLAN_MOUNT_DIR}.",
            )
            continue
        for spec in pod_specs(job):
            if not mounts_config_map(spec, cm_name):
                report(
                    job,
                    f"{job.label} does not mount the plan ConfigMap '{cm_name}'. Fix: add a configMap volume "
                    f"for '{cm_name}' and mount it at {PLAN_MOUNT_DIR} (the trainer reads --plan "
                    f"{PLAN_MOUNT_PATH}).",
                )
