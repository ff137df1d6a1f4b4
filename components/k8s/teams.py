"""The teams that share the training pool (issue 36, item 4; supernode:teams): each a namespace of its
own, guarded like the training namespace, sized by its own ResourceQuota, and reachable only by its
Kubernetes group; an admin group that reads every team's jobs.

The names are supernode.core.teams' (namespace team-<name>, group supernode:team:<name>, the admin
group supernode:admins); the figures are the Plan's (Plan.teams, supernode.core.pools.TeamShare): the
quota is what the team may ever hold, nominal + borrowing limit, in whole nodes of the pod shape. Its
LocalQueue and ClusterQueue are the Queues component's (components/k8s/queues.py); its people's IAM role
is mapped to its group by an EKS access entry (components/aws/cluster.py, TeamAccess).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from supernode.core import teams as names
from supernode.core.capacity import PodShape
from supernode.core.pools import TeamShare

from .common import bound_role, meta
from .namespace import (
    FsxVolume,
    container_limits,
    network_policies,
    pod_guard,
    trainer_claim,
    trainer_service_account,
    training_namespace,
    training_quota,
)

QUEUE_VIEWER_ROLE = "kueue-pending-workloads-lq-viewer"  # components/addons/kueue-observability.yaml
TEAM_ROLE = "supernode-team"  # the Role in each team's namespace, bound to that team's group
ADMIN_ROLE = "supernode-team-admin"  # the ClusterRole bound to the admin group
JOBS_API = "kubeflow.org"
KUEUE_API = "kueue.x-k8s.io"
# What a team's people do in their namespace: submit (server-side apply: patch), watch and cancel their
# jobs and the plan ConfigMaps beside them, read their pods and logs, and see where Kueue has them.
TEAM_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": [JOBS_API],
        "resources": ["pytorchjobs"],
        "verbs": ["create", "patch", "get", "list", "watch", "delete"],
    },
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "patch", "get", "list", "watch", "delete"]},
    {"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [KUEUE_API], "resources": ["workloads", "localqueues"], "verbs": ["get", "list", "watch"]},
]
# The admin group reads everything of the jobs API in every namespace (every team's), changes nothing.
ADMIN_RULES: list[dict[str, Any]] = [
    {"apiGroups": [JOBS_API], "resources": ["pytorchjobs"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["configmaps", "pods", "pods/log"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": [KUEUE_API],
        "resources": ["workloads", "localqueues", "clusterqueues"],
        "verbs": ["get", "list", "watch"],
    },
]


def group_subject(group: str) -> dict[str, str]:
    return {"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": group}


@dataclass(frozen=True)
class TeamNamespaceArgs:
    team: TeamShare  # the Plan's figures for the team (Plan.teams)
    pod: PodShape  # the whole-node pod its jobs request (Plan.pod)
    cluster_version: str
    pod_identity: bool  # True: EKS Pod Identity (the agent's address is reachable); False: IRSA
    # What a submitted job's pods need in the namespace (supernode.tools.jobs_cluster renders them as the
    # stack's own job): the trainer's service account (the trainer role) and the FSx claim.
    service_account: str
    trainer_role_arn: pulumi.Input[str]
    fsx: FsxVolume


class TeamNamespace(pulumi.ComponentResource):
    """A team's namespace: Pod Security as the training namespace (baseline + EFA's IPC_LOCK), its
    ResourceQuota (what the team may ever hold: nominal + borrowing limit, whole nodes), container
    limits, default-deny network policies, and the Role its group is bound to there (and nowhere else)."""

    def __init__(self, name: str, args: TeamNamespaceArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:workload:TeamNamespace", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        namespace = names.namespace(args.team.name)
        self.name = namespace
        self.team = args.team.name
        self.group = names.group(args.team.name)
        self.namespace = training_namespace(f"{name}-ns", namespace, args.cluster_version, child)
        ns = self.namespace.metadata.name
        pod_guard(name, namespace, child)
        self.quota = training_quota(f"{name}-quota", ns, args.team.max_nodes, args.pod, child, quota_name="team-quota")
        self.limits = container_limits(f"{name}-limits", ns, args.pod, child)
        self.network_policies = network_policies(name, ns, args.pod_identity, child)
        self.role, self.binding = bound_role(
            f"{name}-role", TEAM_ROLE, ns, TEAM_RULES, [group_subject(self.group)], child
        )
        # Where its jobs wait: the visibility API's pending workloads of its LocalQueue (Kueue's viewer role).
        self.queue_viewer = k8s.rbac.v1.RoleBinding(
            f"{name}-queue-viewer",
            metadata=meta("supernode-team-queue-viewer", ns),
            role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": QUEUE_VIEWER_ROLE},
            subjects=[group_subject(self.group)],
            opts=child,
        )
        self.service_account = trainer_service_account(
            f"{name}-sa", args.service_account, ns, args.trainer_role_arn, args.pod_identity, child
        )
        after_namespace = pulumi.ResourceOptions(parent=self, depends_on=[self.namespace])
        self.claim = trainer_claim(name, args.fsx, namespace, after_namespace)
        self.register_outputs({"namespace": ns, "group": self.group})


@dataclass(frozen=True)
class TeamAdminArgs:
    namespaces: Sequence[pulumi.Resource]  # the teams' namespaces: the binding comes after them


class TeamAdmin(pulumi.ComponentResource):
    """The admin group (supernode:admins) reads every team's jobs: a read-only ClusterRole on the jobs
    API bound cluster-wide."""

    def __init__(self, name: str, args: TeamAdminArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:workload:TeamAdmin", name, None, opts)
        child = pulumi.ResourceOptions(parent=self, depends_on=list(args.namespaces))
        self.role, self.binding = bound_role(
            f"{name}-role", ADMIN_ROLE, None, ADMIN_RULES, [group_subject(names.ADMIN_GROUP)], child
        )
        self.register_outputs({"group": names.ADMIN_GROUP})


def team_namespaces(
    teams: Sequence[TeamShare], shared: TeamNamespaceArgs, opts: pulumi.ResourceOptions
) -> list[TeamNamespace]:
    """Every team's namespace (one set of team figures: the config rules allow one training pool);
    `shared`: the arguments all teams have alike (its `team` is replaced by each team's)."""
    return [TeamNamespace(f"workload-team-{t.name}", replace(shared, team=t), opts) for t in teams]
