"""The fabric re-check's verdict reaches the node: the ConfigMap patch the check sends (validated like
every manifest) and the node agent's rounds on it, quarantine by a fresh verdict, release after a
check that passes, stale verdicts ignored."""

from __future__ import annotations

import urllib.error
from pathlib import Path

import pytest

from supernode.core.catalog import EKS_ADDON_VERSIONS
from supernode.tools import manifests as mf
from supernode.trainer.node import agent, fabric, health

VERSION = max(EKS_ADDON_VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
FIXTURES = Path(__file__).parent / "fixtures" / "health"
ME, PEERS = "ip-10-0-1-5.ec2.internal", ["ip-10-0-1-6.ec2.internal", "ip-10-0-1-7.ec2.internal"]
PATH = "/api/v1/namespaces/supernode-node-health/configmaps/fabric-verdict"
DAY = 86400.0
NODE = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {
        "name": ME,
        "resourceVersion": "4711",
        "uid": "6f1c0c2e-1",
        "labels": {agent.INSTANCE_TYPE_LABEL: "p5.48xlarge"},
    },
    "spec": {
        "providerID": "aws:///us-east-1a/i-0123456789abcdef0",
        "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
    },
}


def pair(a: str, b: str, gb_s: float) -> dict:
    return {"pair": [a, b], "gb_s": gb_s, "latency_us": 50.0}


def check(me_gb_s: float, when: float) -> dict:
    """A fabric re-check over three nodes, my pairs at `me_gb_s` (the others' at 100 GB/s): its patch."""
    pairs = [pair(PEERS[0], PEERS[1], 100.0)] + [pair(ME, p, me_gb_s) for p in PEERS]
    found = fabric.compare(pairs, threshold=0.2)
    return fabric.verdict_patch("supernode-node-health", "fabric-verdict", {"pairs": pairs}, found, when)


def test_the_verdict_names_every_measured_node_and_validates() -> None:
    body = check(40.0, when=1000.0)
    assert mf.validate([body], VERSION) == []
    assert sorted(body["data"]) == sorted([ME, *PEERS])
    verdicts = {n: health.fabric_verdict(body["data"], n, 1000.0, DAY) for n in body["data"]}
    assert verdicts == {ME: (True, "named slow"), PEERS[0]: (False, "passed"), PEERS[1]: (False, "passed")}
    assert "2 of 2 pairs regressed" in body["data"][ME]


@pytest.mark.parametrize(
    ("entries", "now", "expected"),
    [
        ({}, 1000.0, (None, "no verdict")),  # never measured (a serving node)
        ({ME: "not json"}, 1000.0, (None, "unreadable verdict")),
        ({ME: '{"time": 1, "suspect": "yes"}'}, 1000.0, (None, "unreadable verdict")),
        ({ME: health.fabric_entry(1000.0, True, "")}, 1000.0 + 2 * DAY, (True, "named slow")),  # at the limit
    ],
)
def test_only_a_readable_fresh_entry_is_a_verdict(entries: dict, now: float, expected: tuple) -> None:
    assert health.fabric_verdict(entries, ME, now, 2 * DAY) == expected


def test_a_stale_verdict_is_ignored() -> None:
    suspect, state = health.fabric_verdict(check(40.0, 1000.0)["data"], ME, 1000.0 + 2 * DAY + 1, 2 * DAY)
    assert suspect is None and state.startswith("stale verdict")


class Cluster(agent.Kube):
    """The API paths the agent calls, answered from memory: this node, and the verdict ConfigMap
    (None: the GET fails, as a 403 or a lost connection would)."""

    def __init__(self) -> None:
        self.node_obj, self.verdict, self.sent = NODE, {}, []

    def call(self, method: str, path: str, body: dict | None = None, content_type: str = "application/json") -> dict:
        self.sent.append((method, path, body, content_type))
        if method == "GET" and path == PATH:
            if self.verdict is None:
                raise urllib.error.HTTPError(path, 403, "Forbidden", None, None)  # type: ignore[arg-type]
            return {"apiVersion": "v1", "kind": "ConfigMap", "data": self.verdict}
        if method == "GET":
            return self.node_obj
        if method == "PATCH" and path.startswith("/api/v1/nodes/"):  # the node as the API server keeps it
            self.node_obj = {**self.node_obj, "spec": {**self.node_obj["spec"], "taints": body["spec"]["taints"]}}
        return {}


def healthy(efa_before: dict | None) -> health.Readings:
    return health.Readings(
        nvidia_smi_q=(FIXTURES / "nvidia-smi-q.txt").read_text(),
        nvlink_status=(FIXTURES / "nvlink-s.txt").read_text(),
        dcgmi_health=(FIXTURES / "dcgmi-health-healthy.txt").read_text(),
        efa_before=efa_before,
        efa_now={f"rdmap{i}s0": {"cmds_err": 0} for i in range(32)},
    )


def unhealthy_taints(kube: Cluster) -> list[str]:
    return [t.get("value", "") for t in kube.node_obj["spec"]["taints"] if t["key"] == agent.UNHEALTHY_TAINT]


def test_a_node_named_slow_is_quarantined_until_a_check_passes() -> None:
    kube = Cluster()
    watch = agent.Watch(
        ME,
        None,
        [],
        health.Tracker(release_after=2, replace_after=10, window_s=DAY),
        ("supernode-node-health", "fabric-verdict"),
        2 * DAY,
        checked=True,
    )

    def round_at(now: float) -> dict:
        return watch.round(kube, None, healthy, list, now)

    kube.verdict = check(40.0, when=1000.0)["data"]
    line = round_at(1100.0)
    assert (line["action"], line["fabric"]) == (health.QUARANTINE, "named slow")
    assert unhealthy_taints(kube) == ["fabric"]  # the value the fabric re-check's pods tolerate
    # A failed read keeps the last verdict: the node stays out.
    kube.verdict = None
    line = round_at(1200.0)
    assert line["action"] == health.STAY and line["node_quarantined"] == 1
    assert line["fabric"].startswith("named slow (last read; this one failed: HTTP Error 403")
    # The next check measures the node at full speed: released after the tracker's passes.
    kube.verdict = check(100.0, when=DAY)["data"]
    assert [round_at(DAY + 100.0 * i)["action"] for i in (1, 2)] == [health.STAY, health.RELEASE]
    assert unhealthy_taints(kube) == []


def test_a_stale_named_slow_verdict_keeps_no_node_out() -> None:
    kube = Cluster()
    kube.verdict = check(40.0, when=1000.0)["data"]
    watch = agent.Watch(
        ME, None, [], health.Tracker(1, 10, DAY), ("supernode-node-health", "fabric-verdict"), 2 * DAY, checked=True
    )
    line = watch.round(kube, None, healthy, list, 1000.0 + 2 * DAY + 1)
    assert line["action"] == health.STAY and line["fabric"].startswith("stale verdict") and unhealthy_taints(kube) == []


def test_the_check_patches_the_one_configmap_as_a_merge_patch() -> None:
    """What rank 0 sends (fabric.main: Kube().patch_configmap(verdict_patch(...)))."""
    kube, body = Cluster(), check(100.0, when=1000.0)
    kube.patch_configmap(body)
    assert kube.sent == [("PATCH", PATH, body, "application/merge-patch+json")]
