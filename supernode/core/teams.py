"""The names a team's objects have on the cluster (issue 36, item 4): one place, read by the stack's
components (which create them), the job API (which submits into them) and the policies.

A team `research` owns the namespace `team-research`; its jobs queue in the LocalQueue that every
queued namespace has (`gpu-<accelerator>`, supernode.components.k8s.queues.queue_name), which points
at the team's ClusterQueue `gpu-<accelerator>-research` in the pool's cohort; its people reach the
cluster as the Kubernetes group `supernode:team:research` (an EKS access entry of its IAM
principal), bound to its namespace only. The admin group sees every team.

A job's priority (low | normal | high, supernode.core.jobs) is one of Kueue's WorkloadPriorityClasses.
"""

from __future__ import annotations

# A team's (and a job's) name: a Kubernetes object name (RFC 1123 label) short enough for the names
# derived from it (the namespace team-<name>, the ClusterQueue gpu-<accelerator>-<name>, a job's pods).
NAME = r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$"
NAMESPACE_PREFIX = "team-"
ADMIN_GROUP = "supernode:admins"
# The job file's priority -> the WorkloadPriorityClass its PyTorchJob names (components/k8s/queues.py
# PRIORITIES holds their values: high > normal > low, all below serving).
WORKLOAD_PRIORITY = {
    "low": "supernode-experiments",
    "normal": "supernode-training",
    "high": "supernode-training-high",
}


def namespace(team: str) -> str:
    return f"{NAMESPACE_PREFIX}{team}"


def cluster_queue(team: str, accelerator: str) -> str:
    """The team's ClusterQueue in a pool: the pool's queue name (supernode.components.k8s.queues.queue_name,
    gpu-<accelerator> lower-cased: gpu-h100) and the team's name."""
    return f"gpu-{accelerator.lower()}-{team}"


def group(team: str) -> str:
    return f"supernode:team:{team}"
