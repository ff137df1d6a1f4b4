"""The fabric verdict's path in the dev preview: the re-check's pods may patch the one verdict
ConfigMap and nothing else, the agents may get it and nothing else, a node quarantined for the fabric
alone still takes the re-check, and the agents ignore a verdict older than two check intervals."""

from __future__ import annotations

import pytest
from aws_preview import Stack, preview

from supernode.components.k8s.operations import (
    FABRIC_QUARANTINE_TOLERATION,
    FABRIC_SA,
    FABRIC_VERDICT,
    NODE_HEALTH_NAMESPACE,
    NODE_HEALTH_SA,
)
from supernode.core.cron import longest_gap_s
from supernode.tools import manifests as mf
from supernode.trainer.node import agent

HOUR, DAY = 3600, 86400


@pytest.fixture(scope="module")
def stack() -> Stack:
    return preview("dev")


@pytest.fixture(scope="module")
def manifests(stack: Stack) -> list[dict]:
    return mf.from_resources(stack.result.resources)


def subjects_of(manifests: list[dict], account: tuple[str, str]) -> dict[tuple[str, str], list[dict]]:
    """Every Role or ClusterRole bound to the service account (name, namespace): (name, namespace) -> rules."""
    name, namespace = account
    bound = {
        (m["roleRef"]["kind"], m["roleRef"]["name"], m["metadata"].get("namespace", ""))
        for m in manifests
        if m["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and {"kind": "ServiceAccount", "name": name, "namespace": namespace} in m["subjects"]
    }
    return {
        (m["metadata"]["name"], m["metadata"].get("namespace", "")): m["rules"]
        for m in manifests
        if (m["kind"], m["metadata"]["name"], m["metadata"].get("namespace", "")) in bound
        or (m["kind"] == "ClusterRole" and any(k == "ClusterRole" and n == m["metadata"]["name"] for k, n, _ in bound))
    }


@pytest.mark.slow
def test_each_side_may_do_exactly_its_one_call_on_the_one_object(stack: Stack, manifests: list[dict]) -> None:
    wl = stack.cfg.workload
    one = {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [FABRIC_VERDICT]}
    # The re-check's pods: patch the verdict, nothing else anywhere.
    assert subjects_of(manifests, (FABRIC_SA, wl.namespace)) == {
        ("fabric-verdict-writer", NODE_HEALTH_NAMESPACE): [{**one, "verbs": ["patch"]}]
    }
    # The agents: get the verdict (their other rights: tests/components/test_operations.py).
    agents = subjects_of(manifests, (NODE_HEALTH_SA, NODE_HEALTH_NAMESPACE))
    assert agents[("supernode-node-health", NODE_HEALTH_NAMESPACE)] == [{**one, "verbs": ["get"]}]
    assert not any(
        "configmaps" in r["resources"] for k, rules in agents.items() if k[1] != NODE_HEALTH_NAMESPACE for r in rules
    )
    [verdict] = [m for m in manifests if m["kind"] == "ConfigMap" and m["metadata"]["name"] == FABRIC_VERDICT]
    assert verdict["metadata"]["namespace"] == NODE_HEALTH_NAMESPACE and not verdict.get("data")


def by_kind_name(manifests: list[dict], kind: str, name: str) -> dict:
    [m] = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return m


@pytest.mark.slow
def test_the_recheck_writes_the_verdict_the_agents_read_and_no_other_job_may(stack: Stack, manifests) -> None:
    pod = by_kind_name(manifests, "CronJob", "dev-fabric-check")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    ref = f"{NODE_HEALTH_NAMESPACE}/{FABRIC_VERDICT}"
    assert c["args"][c["args"].index("--verdict-configmap") + 1] == ref
    assert pod["serviceAccountName"] == FABRIC_SA and pod["automountServiceAccountToken"] is True
    # A node tainted for the fabric alone (the agent's taint, value the finding) takes the re-check's pod.
    assert (
        FABRIC_QUARANTINE_TOLERATION["key"] == agent.UNHEALTHY_TAINT
        and FABRIC_QUARANTINE_TOLERATION["value"] == "fabric"
    )
    assert FABRIC_QUARANTINE_TOLERATION in pod["tolerations"]
    # The deploy-time gate records no verdict and holds no token.
    [gate] = [m for m in manifests if m["kind"] == "Job"]
    gate_pod = gate["spec"]["template"]["spec"]
    assert (
        gate_pod["automountServiceAccountToken"] is False
        and "--verdict-configmap" not in gate_pod["containers"][0]["args"]
    )
    ds = by_kind_name(manifests, "DaemonSet", "node-health")["spec"]["template"]["spec"]
    [a] = ds["containers"]
    assert a["args"][a["args"].index("--fabric-verdict") + 1] == ref
    max_age = float(a["args"][a["args"].index("--fabric-max-age-s") + 1])
    assert max_age == 2 * longest_gap_s(stack.cfg.workload.fabric_check_schedule) == 14 * DAY
