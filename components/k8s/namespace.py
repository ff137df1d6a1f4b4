"""The training namespace: guard rails (quota, limits, Pod Security, network policy), the trainer's
identity, the FSx volume and the plan. Everything the jobs in it read is created here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from supernode.core.capacity import PodShape
from supernode.core.plan import PLAN_CONFIGMAP_KEY, Plan

from .common import MESH_LABEL, fsx_claim, gib, irsa, meta

PLAN_CONFIGMAP = "supernode-plan"
PVC_NAME = "fsx"
PRIORITY_CLASS = "supernode-training"
IMDS = "169.254.169.254/32"  # pods reach AWS through IRSA web identity, never the node's instance role
POD_IDENTITY_AGENT = "169.254.170.23/32"
# Room for small pods next to the job (a debug shell, a copy job), on top of the job's own pods.
HEADROOM = {"pods": 4, "cpu": 4, "memory_gib": 16}
# Pod Security baseline allows these added capabilities; EFA additionally needs IPC_LOCK (to pin
# memory for RDMA), which baseline forbids and Pod Security admission cannot exempt on its own.
BASELINE_CAPABILITIES = (
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
)
EFA_CAPABILITIES = ("IPC_LOCK",)


@dataclass(frozen=True)
class FsxVolume:
    id: pulumi.Input[str]
    dns_name: pulumi.Input[str]
    mount_name: pulumi.Input[str]
    size_gib: pulumi.Input[int]
    # Directories in the file system (the data repository associations' file-system paths).
    data_dir: str
    checkpoint_dir: str


@dataclass(frozen=True)
class NamespaceArgs:
    namespace: str
    service_account: str
    trainer_role_arn: pulumi.Input[str]
    pod_identity: bool  # True: EKS Pod Identity (agent on the node); False: IRSA annotation
    cluster_version: str
    fsx: FsxVolume
    plan: Plan  # the job's node count and pod shape size the quota


def training_namespace(
    resource: str, name: str, cluster_version: str, opts: pulumi.ResourceOptions
) -> k8s.core.v1.Namespace:
    """PSA has no per-capability exemption: enforce "privileged" at the PSA level, keep baseline as
    warn/audit, and enforce "baseline + IPC_LOCK" with the admission policy (TrainingNamespace's)."""
    psa_version = f"v{cluster_version}"
    return k8s.core.v1.Namespace(
        resource,
        metadata=meta(
            name,
            labels={
                "pod-security.kubernetes.io/enforce": "privileged",
                "pod-security.kubernetes.io/enforce-version": psa_version,
                "pod-security.kubernetes.io/warn": "baseline",
                "pod-security.kubernetes.io/warn-version": psa_version,
                "pod-security.kubernetes.io/audit": "baseline",
                "pod-security.kubernetes.io/audit-version": psa_version,
            },
        ),
        opts=opts,
    )


def training_quota(
    resource: str,
    namespace: pulumi.Input[str],
    nodes: int,
    pod: PodShape,
    opts: pulumi.ResourceOptions,
    quota_name: str = "training-quota",
) -> k8s.core.v1.ResourceQuota:
    """`nodes` whole-node pods' worth of the scarce resources, and headroom for small pods beside them."""
    return k8s.core.v1.ResourceQuota(
        resource,
        metadata=meta(quota_name, namespace),
        spec={
            "hard": {
                # The scarce resources are capped at exactly one job's worth: the GPU fleet.
                f"requests.{pod.device_resource}": str(nodes * pod.gpus),
                "requests.vpc.amazonaws.com/efa": str(nodes * pod.efa),
                "requests.hugepages-2Mi": gib(nodes * pod.hugepages_gib),
                "requests.cpu": str(nodes * pod.cpu + HEADROOM["cpu"]),
                "limits.cpu": str(nodes * pod.cpu + HEADROOM["cpu"]),
                "requests.memory": gib(nodes * pod.memory_gib + HEADROOM["memory_gib"]),
                "limits.memory": gib(nodes * pod.memory_gib + HEADROOM["memory_gib"]),
                "pods": str(nodes + HEADROOM["pods"]),
            }
        },
        opts=opts,
    )


def container_limits(
    resource: str, namespace: pulumi.Input[str], pod: PodShape, opts: pulumi.ResourceOptions
) -> k8s.core.v1.LimitRange:
    """Defaults for the small pods beside the job, and no container larger than the job's pod."""
    return k8s.core.v1.LimitRange(
        resource,
        metadata=meta("training-limits", namespace),
        spec={
            "limits": [
                {
                    "type": "Container",
                    "defaultRequest": {"cpu": "250m", "memory": "512Mi"},
                    "default": {"cpu": "1", "memory": "2Gi"},
                    "max": {"cpu": str(pod.cpu), "memory": gib(pod.memory_gib)},
                }
            ]
        },
        opts=opts,
    )


def trainer_service_account(
    name: str,
    account: str,
    namespace: pulumi.Input[str],
    role_arn: pulumi.Input[str],
    pod_identity: bool,
    opts: pulumi.ResourceOptions,
) -> k8s.core.v1.ServiceAccount:
    """The trainer pods' account (the training namespace's and each team's): the trainer role through IRSA
    or Pod Identity. The trainer never calls the Kubernetes API: no API token in its pods (IRSA mounts its own)."""
    return k8s.core.v1.ServiceAccount(
        name,
        metadata=meta(account, namespace, annotations={} if pod_identity else irsa(role_arn)),
        automount_service_account_token=False,
        opts=opts,
    )


def trainer_claim(name: str, fsx: FsxVolume, namespace: str, opts: pulumi.ResourceOptions):
    """The FSx file system as the trainer pods' claim PVC_NAME in `namespace` (a static volume of its own)."""
    size = pulumi.Output.from_input(fsx.size_gib).apply(gib)
    return fsx_claim(name, fsx.id, fsx.dns_name, fsx.mount_name, namespace, PVC_NAME, size, read_only=False, opts=opts)


class TrainingNamespace(pulumi.ComponentResource):
    def __init__(self, name: str, args: NamespaceArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:workload:TrainingNamespace", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        nodes, pod = args.plan.nodes, args.plan.pod
        self.namespace = training_namespace(f"{name}-ns", args.namespace, args.cluster_version, child)
        ns = self.namespace.metadata.name
        self.name = ns
        pod_guard(name, args.namespace, child)
        self.quota = training_quota(f"{name}-quota", ns, nodes, pod, child)
        self.limits = container_limits(f"{name}-limits", ns, pod, child)
        policies = network_policies(name, ns, args.pod_identity, child)
        self.default_deny, self.allow_dns, self.allow_aws = policies.values()

        self.service_account = trainer_service_account(
            f"{name}-sa", args.service_account, ns, args.trainer_role_arn, args.pod_identity, child
        )
        self.priority_class = k8s.scheduling.v1.PriorityClass(
            f"{name}-priority",
            metadata=meta(PRIORITY_CLASS),
            value=100000,
            global_default=False,
            preemption_policy="PreemptLowerPriority",
            description="supernode training jobs: above batch work, below system-critical pods",
            opts=child,
        )

        after_namespace = pulumi.ResourceOptions(parent=self, depends_on=[self.namespace])
        self.claim = trainer_claim(name, args.fsx, args.namespace, after_namespace)

        # The plan exactly as the core serialises it: the trainer reads this file.
        self.plan_config_map = k8s.core.v1.ConfigMap(
            f"{name}-plan",
            metadata=meta(PLAN_CONFIGMAP, ns),
            data={PLAN_CONFIGMAP_KEY: args.plan.to_json()},
            opts=child,
        )
        self.register_outputs(
            {
                "namespace": ns,
                "service_account": self.service_account.metadata.name,
                "pvc": self.claim.metadata.name,
                "plan_config_map": self.plan_config_map.metadata.name,
            }
        )


def network_policies(
    name: str, ns: pulumi.Input[str], pod_identity: bool, child: pulumi.ResourceOptions
) -> dict[str, k8s.networking.v1.NetworkPolicy]:
    """Default deny, then DNS for every pod and AWS APIs over HTTPS for job pods only. The job's
    pod-to-pod mesh is allowed per job (see workload_jobs.mesh_policy)."""

    def policy(suffix: str, spec: dict[str, Any]) -> k8s.networking.v1.NetworkPolicy:
        return k8s.networking.v1.NetworkPolicy(f"{name}-{suffix}", metadata=meta(suffix, ns), spec=spec, opts=child)

    default_deny = policy("default-deny", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})
    allow_dns = policy(
        "allow-dns",
        {
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [
                        {
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                        }
                    ],
                    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                }
            ],
        },
    )
    # S3 (gateway endpoint: public S3 ranges) and STS are reachable only by IP, and NetworkPolicy
    # cannot match names or prefix lists: allow HTTPS alone, and never the instance metadata service.
    egress: list[dict[str, Any]] = [
        {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": [IMDS]}}], "ports": [{"protocol": "TCP", "port": 443}]}
    ]
    if pod_identity:
        egress.append({"to": [{"ipBlock": {"cidr": POD_IDENTITY_AGENT}}], "ports": [{"protocol": "TCP", "port": 80}]})
    allow_aws = policy(
        "allow-aws-apis",
        {
            "podSelector": {"matchExpressions": [{"key": MESH_LABEL, "operator": "Exists"}]},
            "policyTypes": ["Egress"],
            "egress": egress,
        },
    )
    return {"default-deny": default_deny, "allow-dns": allow_dns, "allow-aws-apis": allow_aws}


def pod_guard(name: str, namespace: str, child: pulumi.ResourceOptions) -> None:
    """Pod Security baseline for this namespace, plus exactly the capabilities EFA needs."""
    allowed = "[" + ", ".join(f"'{c}'" for c in BASELINE_CAPABILITIES + EFA_CAPABILITIES) + "]"
    each = "variables.containers.all(c, {})"
    checks = [
        ("!has(object.spec.hostNetwork) || !object.spec.hostNetwork", "hostNetwork is not allowed"),
        ("!has(object.spec.hostPID) || !object.spec.hostPID", "hostPID is not allowed"),
        ("!has(object.spec.hostIPC) || !object.spec.hostIPC", "hostIPC is not allowed"),
        (
            "!has(object.spec.volumes) || object.spec.volumes.all(v, !has(v.hostPath))",
            "hostPath volumes are not allowed",
        ),
        (
            each.format(
                "!has(c.securityContext) || !has(c.securityContext.privileged) || !c.securityContext.privileged"
            ),
            "privileged containers are not allowed",
        ),
        (
            each.format(
                "!has(c.securityContext) || !has(c.securityContext.capabilities) || "
                f"!has(c.securityContext.capabilities.add) || c.securityContext.capabilities.add.all(a, a in {allowed})"  # noqa: E501
            ),
            f"added capabilities must be among {allowed}",
        ),
    ]
    policy = k8s.admissionregistration.v1.ValidatingAdmissionPolicy(
        f"{name}-pod-guard",
        metadata=meta(f"{namespace}-baseline-plus-efa"),
        spec={
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["pods", "pods/ephemeralcontainers"],
                    }
                ]
            },
            "variables": [
                {
                    "name": "containers",
                    "expression": "object.spec.containers"
                    " + (has(object.spec.initContainers) ? object.spec.initContainers : [])"
                    " + (has(object.spec.ephemeralContainers) ? object.spec.ephemeralContainers : [])",
                }
            ],
            "validations": [{"expression": e, "message": m} for e, m in checks],
        },
        opts=child,
    )
    k8s.admissionregistration.v1.ValidatingAdmissionPolicyBinding(
        f"{name}-pod-guard",
        metadata=meta(f"{namespace}-baseline-plus-efa"),
        spec={
            "policyName": policy.metadata.name,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}},
        },
        opts=child,
    )
