"""The management page in the cluster (issue 37, item 2): `supernode ui --cluster` in its own namespace,
on the system nodes, behind the internal load balancer of components/aws/management.py.

- Deployment: the project's image running `supernode ui --cluster` over the stack's config (a ConfigMap
  of the stack file, as the operations' CronJobs mount it), one replica (the CSRF secret is the
  process's own), restricted Pod Security, read-only root.
- Service: NodePort NODE_PORT (the load balancer's target group names it) with
  `externalTrafficPolicy: Local`, so the page sees the load balancer's address, not a node's.
- NetworkPolicy: in, the page's port from the private subnets only (where the load balancer's
  interfaces are); out, DNS and HTTPS (the API server, CloudWatch Logs, the ALB's key endpoint).
- ServiceAccount with its IRSA role (the audit log group only), and RBAC: one ClusterRole with exactly
  what supernode.tools.jobs_cluster.ClusterBackend calls, bound by a RoleBinding in each team's
  namespace only (never cluster-wide): the page reaches no namespace but the teams'. Its nodes page
  (ClusterBackend.nodes) lists the Nodes, which are cluster-scoped: a second ClusterRole granting
  exactly `list nodes`, bound cluster-wide by a ClusterRoleBinding (nothing else is cluster-wide).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from supernode.core.config import StackConfig

from ..aws.management import HEALTH_PATH, NODE_PORT
from .common import irsa, meta, pod_security_namespace
from .operations import RESTRICTED, small, stack_file
from .teams import JOBS_API, KUEUE_API

NAMESPACE = "supernode-management"
NAME = "management-ui"
PORT = 8080
APP = {"app.kubernetes.io/name": NAME}
STACK_MOUNT = "/etc/supernode"
SYSTEM_NODES = {"supernode.io/role": "system"}  # components/aws/accelerators.py's system node group label
# Each verb a ClusterBackend request needs (jobs_cluster.py): submit is server-side apply (PATCH) of the
# PyTorchJob, its plan ConfigMap and mesh NetworkPolicy; list/describe GET the jobs, LIST Kueue's Workloads
# and the pods, GET a LocalQueue's pending workloads (visibility API) and rank 0's log; cancel DELETEs the
# job and its pods. Nothing else: no watch, no update, no secrets, no other namespace.
UI_RULES: list[dict[str, Any]] = [
    {"apiGroups": [JOBS_API], "resources": ["pytorchjobs"], "verbs": ["get", "list", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["patch"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": [KUEUE_API], "resources": ["workloads"], "verbs": ["list"]},
    {"apiGroups": ["visibility.kueue.x-k8s.io"], "resources": ["localqueues/pendingworkloads"], "verbs": ["get"]},
]
NODES_ROLE = f"supernode-{NAME}-nodes"
NODE_RULES: list[dict[str, Any]] = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]


@dataclass(frozen=True)
class ManagementUiArgs:
    stack: str
    cfg: StackConfig  # its management.ui is set
    image: str
    role_arn: pulumi.Input[str]  # the page's IRSA role (audit log group only)
    signer: pulumi.Input[str]  # the load balancer's ARN: the identity header it signs is trusted
    audit_log_group: pulumi.Input[str]
    team_namespaces: Sequence[str]
    lb_cidrs: Sequence[str]  # where the load balancer's interfaces are (the private subnets)
    after: Sequence[pulumi.Resource] = ()  # the team namespaces


def container(args: ManagementUiArgs, filename: str) -> dict[str, Any]:
    probe = {"httpGet": {"path": HEALTH_PATH, "port": PORT}, "periodSeconds": 10}
    command = ["supernode", "ui", "--cluster", "--config", f"{STACK_MOUNT}/{filename}", "--port", str(PORT)]
    return {
        "name": "ui",
        "image": args.image,
        "command": command,
        "args": ["--signer", args.signer, "--audit-log-group", args.audit_log_group],
        "env": [{"name": "AWS_REGION", "value": args.cfg.region}, {"name": "HOME", "value": "/tmp"}],
        "ports": [{"name": "http", "containerPort": PORT}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": small("250m", "512Mi", "1", "1Gi"),
        "securityContext": {**RESTRICTED, "readOnlyRootFilesystem": True},
        "volumeMounts": [
            {"name": "stack", "mountPath": STACK_MOUNT, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def network_policy_spec(lb_cidrs: Sequence[str]) -> dict[str, Any]:
    return {
        "podSelector": {"matchLabels": APP},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": [{"ipBlock": {"cidr": c}} for c in lb_cidrs], "ports": [{"port": PORT}]}],
        "egress": [
            {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
            {"ports": [{"port": 443, "protocol": "TCP"}]},
        ],
    }


class ManagementUi(pulumi.ComponentResource):
    """The page's namespace, service account, RBAC, Deployment, Service and NetworkPolicy."""

    def __init__(self, name: str, args: ManagementUiArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:management:ManagementUi", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.namespace = pod_security_namespace(f"{name}-ns", NAMESPACE, "restricted", "restricted", child)
        in_ns = pulumi.ResourceOptions(parent=self, depends_on=[self.namespace])
        self.service_account = k8s.core.v1.ServiceAccount(
            f"{name}-sa", metadata=meta(NAME, NAMESPACE, annotations=irsa(args.role_arn)), opts=in_ns
        )
        self.role = k8s.rbac.v1.ClusterRole(
            f"{name}-role", metadata=meta(f"supernode-{NAME}"), rules=UI_RULES, opts=child
        )
        subject = {"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}
        self.nodes_role = k8s.rbac.v1.ClusterRole(
            f"{name}-nodes-role", metadata=meta(NODES_ROLE), rules=NODE_RULES, opts=child
        )
        self.nodes_binding = k8s.rbac.v1.ClusterRoleBinding(
            f"{name}-nodes",
            metadata=meta(NODES_ROLE),
            role_ref={
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": self.nodes_role.metadata.name,
            },
            subjects=[subject],
            opts=child,
        )
        after_teams = pulumi.ResourceOptions(parent=self, depends_on=list(args.after))
        self.bindings = [
            k8s.rbac.v1.RoleBinding(
                f"{name}-{ns}",
                metadata=meta(f"supernode-{NAME}", ns),
                role_ref={
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": self.role.metadata.name,
                },
                subjects=[subject],
                opts=after_teams,
            )
            for ns in args.team_namespaces
        ]
        filename = f"Pulumi.{args.stack}.yaml"
        stack_cm = k8s.core.v1.ConfigMap(
            f"{name}-stack",
            metadata=meta(f"{NAME}-stack", NAMESPACE),
            data={filename: stack_file(args.cfg)},
            opts=in_ns,
        )
        self.deployment = self._deployment(name, args, filename, stack_cm, in_ns)
        self.service = k8s.core.v1.Service(
            f"{name}-svc",
            metadata=meta(NAME, NAMESPACE, labels=APP),
            spec={
                "type": "NodePort",
                "externalTrafficPolicy": "Local",
                "selector": APP,
                "ports": [{"name": "http", "port": PORT, "targetPort": PORT, "nodePort": NODE_PORT}],
            },
            opts=in_ns,
        )
        self.network_policy = k8s.networking.v1.NetworkPolicy(
            f"{name}-netpol", metadata=meta(NAME, NAMESPACE), spec=network_policy_spec(args.lb_cidrs), opts=in_ns
        )
        self.register_outputs({"namespace": NAMESPACE, "node_port": NODE_PORT})

    def _deployment(
        self,
        name: str,
        args: ManagementUiArgs,
        filename: str,
        stack_cm: k8s.core.v1.ConfigMap,
        opts: pulumi.ResourceOptions,
    ) -> k8s.apps.v1.Deployment:
        pod = {
            "serviceAccountName": self.service_account.metadata.name,
            "nodeSelector": SYSTEM_NODES,
            "securityContext": {
                "seccompProfile": {"type": "RuntimeDefault"},
                "runAsNonRoot": True,
            },  # image: USER 10001
            "containers": [container(args, filename)],
            "volumes": [
                {"name": "stack", "configMap": {"name": stack_cm.metadata.name}},
                {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
            ],
        }
        return k8s.apps.v1.Deployment(
            f"{name}-deploy",
            metadata=meta(NAME, NAMESPACE, labels=APP),
            spec={
                "replicas": 1,  # one process: the CSRF secret is its own (a second replica would refuse its forms)
                "selector": {"matchLabels": APP},
                "template": {"metadata": {"labels": {**APP}}, "spec": pod},
            },
            opts=opts,
        )
