"""The node health agent's API requests: Kubernetes bodies validated against the API schemas, and
the replacement call against a real moto server."""

from __future__ import annotations

import re
import socket
import urllib.error
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import boto3
import pytest
from aws_preview import Stack
from moto.server import ThreadedMotoServer

from supernode.core import observability as obs
from supernode.core import resource_types as T
from supernode.core.catalog import EKS_ADDON_VERSIONS
from supernode.core.errors import EXIT_BAD_INPUT
from supernode.tools import manifests as mf
from supernode.trainer.node import agent, health

VERSION = max(EKS_ADDON_VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
NODE = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {"name": "ip-10-0-1-5.ec2.internal", "resourceVersion": "4711", "uid": "6f1c0c2e-1"},
    "spec": {
        "providerID": "aws:///us-east-1a/i-0123456789abcdef0",
        "taints": [
            {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"},
            {"key": agent.UNCHECKED_TAINT, "effect": "NoSchedule"},
        ],
    },
}


def taints(body: dict) -> list[tuple]:
    return [(t["key"], t.get("value"), t["effect"]) for t in body["spec"]["taints"]]


def test_quarantine_patch_keeps_other_taints_and_validates() -> None:
    body = agent.node_patch(NODE, "quarantined", "xid", "xid: Xid 74 on PCI:0000:53:00", checked=True)
    assert mf.validate([body], VERSION) == []
    assert taints(body) == [("nvidia.com/gpu", "true", "NoSchedule"), (agent.UNHEALTHY_TAINT, "xid", "NoSchedule")]
    assert body["metadata"]["labels"] == {agent.HEALTH_LABEL: "quarantined"}
    assert body["metadata"]["resourceVersion"] == "4711"


def test_release_removes_our_taints_only_after_the_deep_check() -> None:
    sick = {
        **NODE,
        "spec": {
            **NODE["spec"],
            "taints": agent.node_patch(NODE, "quarantined", "ecc", "", checked=False)["spec"]["taints"],
        },
    }
    unchecked = agent.node_patch(sick, "ok", "", "", checked=False)
    assert taints(unchecked) == [("nvidia.com/gpu", "true", "NoSchedule"), (agent.UNCHECKED_TAINT, None, "NoSchedule")]
    released = agent.node_patch(sick, "ok", "", "", checked=True)
    assert mf.validate([released], VERSION) == []
    assert taints(released) == [("nvidia.com/gpu", "true", "NoSchedule")]


def test_eviction_and_event_bodies_validate() -> None:
    pod = {"metadata": {"name": "train-worker-3", "namespace": "supernode-train"}}
    ev = agent.event(NODE, "NodeQuarantined", "x" * 2000, datetime(2026, 12, 4, 13, 0, tzinfo=UTC))
    assert mf.validate([agent.eviction(pod), ev], VERSION) == []
    assert ev["involvedObject"]["name"] == NODE["metadata"]["name"] and len(ev["message"]) == 1000
    assert ev["lastTimestamp"] == "2026-12-04T13:00:00Z"


def test_instance_id_comes_from_the_provider_id() -> None:
    assert agent.instance_id(NODE) == "i-0123456789abcdef0"
    with pytest.raises(agent.BadInput, match="spec.providerID 'kind://x' names no EC2 instance"):
        agent.instance_id({"metadata": {"name": "n"}, "spec": {"providerID": "kind://x"}})


def test_dcgmi_diag_failures() -> None:
    text = """+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Deployment  --------+------------------------------------------------|
| Denylist                  | Pass                                           |
| NVML Library              | Pass                                           |
+-----  Hardware  ----------+------------------------------------------------+
| GPU Memory                | Fail - GPU: 2                                  |
| Diagnostic                | Pass - All                                     |
+-----  Integration  -------+------------------------------------------------+
| PCIe                      | Pass - All                                     |
+---------------------------+------------------------------------------------+
"""
    assert agent.parse_dcgmi_diag(text) == ["GPU Memory"]


def test_efa_counters_read_from_sysfs(tmp_path) -> None:
    counters = tmp_path / "rdmap16s27" / "ports" / "1" / "hw_counters"
    counters.mkdir(parents=True)
    (counters / "cmds_err").write_text("2\n")
    (counters / "tx_bytes").write_text("1024\n")
    assert agent.read_efa_counters(tmp_path) == {"rdmap16s27": {"cmds_err": 2, "tx_bytes": 1024}}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["watch", "--instance-type", "p9.huge"], "--instance-type: instance type 'p9.huge' is not in the catalog"),
        (["watch", "--instance-type", "trn2.48xlarge"], "--instance-type: trn2.48xlarge is not an NVIDIA GPU instance"),
        (
            ["watch", "--instance-type", "p5.48xlarge", "--release-after", "0"],
            "--release-after must be at least 1, got 0",
        ),
        (["watch", "--instance-type", "p5.48xlarge", "--interval-s", "5"], "--interval-s must be at least 30, got 5"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv: list[str], message: str, capsys) -> None:
    assert agent.main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


class RecordingKube(agent.Kube):
    """The agent's API paths and bodies, answered from memory instead of a cluster (`configmaps`: by
    API path; a path not there answers 404, as the API server would)."""

    def __init__(self, node: dict, pods: list[dict], configmaps: dict[str, dict] | None = None) -> None:
        self.node_obj, self.pods, self.configmaps, self.sent = node, pods, configmaps or {}, []

    def call(self, method: str, path: str, body: dict | None = None, content_type: str = "application/json") -> dict:
        self.sent.append((method, path.split("?")[0], content_type, body))
        if method == "GET" and path.startswith("/api/v1/nodes/"):
            return self.node_obj
        if method == "GET" and "/configmaps/" in path:
            if path not in self.configmaps:
                raise urllib.error.HTTPError(path, 404, "Not Found", None, None)  # type: ignore[arg-type]
            return self.configmaps[path]
        if method == "GET":
            return {"items": self.pods}
        return {}


def auto_scaling_group(moto_url: str, name: str, min_size: int, max_size: int, desired: int):
    """(ec2, autoscaling clients, the id of the group's first instance): a GPU node group as moto runs it."""
    kwargs = {
        "endpoint_url": moto_url,
        "region_name": "us-east-1",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
    }
    ec2, autoscaling = boto3.client("ec2", **kwargs), boto3.client("autoscaling", **kwargs)
    template = ec2.create_launch_template(
        LaunchTemplateName=name, LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.micro"}
    )["LaunchTemplate"]["LaunchTemplateId"]
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=name,
        LaunchTemplate={"LaunchTemplateId": template},
        MinSize=min_size,
        MaxSize=max_size,
        DesiredCapacity=desired,
        AvailabilityZones=["us-east-1a"],
    )
    group = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]
    return ec2, autoscaling, group["Instances"][0]["InstanceId"]


def test_replacement_terminates_without_shrinking_the_group(moto_url: str) -> None:
    ec2, autoscaling, victim = auto_scaling_group(moto_url, "gpu-nodes", 0, 4, 2)

    activity = agent.replace_instance(autoscaling, victim)

    assert activity["AutoScalingGroupName"] == "gpu-nodes"
    after = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=["gpu-nodes"])["AutoScalingGroups"][0]
    assert after["DesiredCapacity"] == 2
    assert victim not in {i["InstanceId"] for i in after["Instances"]}
    assert len(after["Instances"]) == 2  # the group launched the replacement
    state = ec2.describe_instances(InstanceIds=[victim])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state in ("shutting-down", "terminated")


def test_the_scrape_keeps_the_fault_counters() -> None:
    dcgm = next(d for d in obs.METRIC_DECLARATIONS if d["label_matcher"] == f"^{obs.DCGM_SCRAPE_JOB}$")
    for metric in (obs.ECC_DBE, obs.ROW_REMAP_FAILURE, obs.PCIE_REPLAYS):
        assert re.fullmatch(dcgm["metric_selectors"][0], metric), metric


def test_alarms_on_quarantine_replacement_and_gpu_faults(stack: Stack) -> None:
    found = {
        r.inputs["name"].removeprefix(f"supernode-{stack.result.stack}-"): r.inputs for r in stack.all(T.METRIC_ALARM)
    }
    filters = {r.inputs["metricTransformation"]["name"]: r.inputs for r in stack.all(T.LOG_METRIC_FILTER)}
    # The agent's JSON line carries the fields the filters read.
    assert filters["NodesQuarantined"]["pattern"] == "{ $.node_quarantined = * }"
    assert filters["NodesQuarantined"]["metricTransformation"]["value"] == "$.node_quarantined"
    assert filters["NodesReplaced"]["pattern"] == "{ $.node_replaced = 1 }"
    assert found["node-quarantined"]["metricName"] == "NodesQuarantined"
    assert found["node-replaced"]["metricName"] == "NodesReplaced"
    assert filters["NodeChecksNotRun"]["pattern"] == "{ $.checks_not_run = * }"
    assert filters["NodeChecksNotRun"]["metricTransformation"]["value"] == "$.checks_not_run"
    assert (found["node-checks-not-run"]["metricName"], found["node-checks-not-run"]["threshold"]) == (
        "NodeChecksNotRun",
        0,
    )
    for alarm, metric in (("gpu-ecc-uncorrectable", obs.ECC_DBE), ("gpu-row-remap-failure", obs.ROW_REMAP_FAILURE)):
        assert (found[alarm]["namespace"], found[alarm]["metricName"]) == (obs.PROMETHEUS_NAMESPACE, metric)
        assert found[alarm]["threshold"] == 0
    replays = found["gpu-pcie-replays"]
    assert replays["threshold"] == 8
    assert [q.get("expression") for q in replays["metricQueries"]] == [None, "RATE(replays) * 60"]
    assert replays["metricQueries"][0]["metric"]["metricName"] == obs.PCIE_REPLAYS


def test_a_hardware_fault_taints_records_evicts_and_replaces(moto_url: str) -> None:
    _, autoscaling, victim = auto_scaling_group(moto_url, "gpu-nodes-act", 1, 1, 1)
    node = {**NODE, "spec": {**NODE["spec"], "providerID": f"aws:///us-east-1a/{victim}"}}
    pod = {"metadata": {"name": "train-worker-0", "namespace": "supernode-train"}}
    kube = RecordingKube(node, [pod])
    verdict = health.Verdict((health.Finding("xid", health.HARDWARE, "Xid 79 on PCI:0000:64:00"),))

    line = agent.act(
        kube, autoscaling, NODE["metadata"]["name"], health.EVICT_AND_REPLACE, verdict, ["supernode-train"], True, True
    )

    sent = [(m, p, c) for m, p, c, _ in kube.sent if m != "GET"]
    assert sent == [
        ("PATCH", f"/api/v1/nodes/{NODE['metadata']['name']}", "application/merge-patch+json"),
        ("POST", "/api/v1/namespaces/default/events", "application/json"),
        ("POST", "/api/v1/namespaces/supernode-train/pods/train-worker-0/eviction", "application/json"),
    ]
    bodies = [b for m, _, _, b in kube.sent if m != "GET"]
    assert mf.validate(bodies, VERSION) == []
    assert bodies[0]["metadata"]["labels"] == {agent.HEALTH_LABEL: "replacing"}
    assert line["node_replaced"] == 1 and line["replacement_activity"]
    group = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=["gpu-nodes-act"])["AutoScalingGroups"][0]
    assert group["DesiredCapacity"] == 1 and victim not in {i["InstanceId"] for i in group["Instances"]}


def test_a_passed_deep_check_does_not_admit_a_quarantined_node() -> None:
    kube = RecordingKube(NODE, [])
    agent.act(kube, None, NODE["metadata"]["name"], health.STAY, health.Verdict(()), [], True, True)
    assert [m for m, *_ in kube.sent] == ["GET"]  # still held back: no patch
    agent.act(kube, None, NODE["metadata"]["name"], health.STAY, health.Verdict(()), [], True, False)
    patch = kube.sent[-1][3]
    assert [t["key"] for t in patch["spec"]["taints"]] == ["nvidia.com/gpu"]


# -- each node judged as its own instance type -------------------------------------------------------

FIXTURES = Path(__file__).parents[1] / "trainer" / "fixtures" / "health"


def labelled(node: dict, instance_type: str) -> dict:
    return {**node, "metadata": {**node["metadata"], "labels": {agent.INSTANCE_TYPE_LABEL: instance_type}}}


def p5en_readings(efa_before: dict | None) -> health.Readings:
    """A healthy p5en.48xlarge as its tools print it: 8 H200 on NVLink, 16 EFA devices."""
    return health.Readings(
        nvidia_smi_q=(FIXTURES / "nvidia-smi-q.txt").read_text(),
        nvlink_status=(FIXTURES / "nvlink-s.txt").read_text(),
        dmesg=(FIXTURES / "dmesg-app-only.txt").read_text(),
        ecc_remap=(FIXTURES / "ecc-remap-ok.txt").read_text(),
        dcgmi_health=(FIXTURES / "dcgmi-health-healthy.txt").read_text(),
        efa_before=efa_before,
        efa_now={f"rdmap{i}s0": {"cmds_err": 0} for i in range(16)},
    )


def watch(fallback: str | None = "p5.48xlarge", **kw) -> agent.Watch:
    return agent.Watch(NODE["metadata"]["name"], fallback, [], health.Tracker(3, 3, 86400), **kw)


def test_a_serving_node_of_another_type_is_judged_as_itself() -> None:
    """The DaemonSet's --instance-type is training's p5.48xlarge; a p5en.48xlarge serving node beside it
    is judged by its own label, passes, and is admitted."""
    kube = RecordingKube(labelled(NODE, "p5en.48xlarge"), [])
    line = watch().round(kube, None, p5en_readings, list, now=1000.0)
    assert (line["instance_type"], line["severity"], line["findings"], line["node_quarantined"]) == (
        "p5en.48xlarge",
        health.OK,
        "",
        0,
    )
    [(method, _, _, patch)] = [s for s in kube.sent if s[0] != "GET"]
    assert method == "PATCH" and patch["metadata"]["labels"] == {agent.HEALTH_LABEL: "ok"}
    assert taints(patch) == [("nvidia.com/gpu", "true", "NoSchedule")]  # the deep check passed: admitted
    # Judged as the training type (the old behaviour) the same node misses half of its EFA devices: a
    # hardware finding, and the node would be replaced for being itself.
    own = {
        (f.check, f.severity)
        for f in health.decide(
            p5en_readings(None), agent.judged_as(labelled(NODE, "p5en.48xlarge"), "p5.48xlarge")
        ).findings
    }
    as_training = {
        (f.check, f.severity) for f in health.decide(p5en_readings(None), agent.lookup("p5.48xlarge")).findings
    }
    assert own == set() and as_training == {("efa", health.HARDWARE)}


@pytest.mark.parametrize(
    ("labels", "fallback", "judged"),
    [
        ({agent.INSTANCE_TYPE_LABEL: "p5en.48xlarge"}, "p5.48xlarge", "p5en.48xlarge"),  # the label wins
        ({}, "p5.48xlarge", "p5.48xlarge"),  # no label: the flag stands in
    ],
)
def test_the_label_decides_the_flag_only_stands_in(labels: dict, fallback: str, judged: str) -> None:
    node = {**NODE, "metadata": {**NODE["metadata"], "labels": labels}}
    assert agent.judged_as(node, fallback).name == judged


@pytest.mark.parametrize(
    ("labels", "fallback", "message"),
    [
        (
            {agent.INSTANCE_TYPE_LABEL: "g6e.48xlarge"},
            "p5.48xlarge",
            "instance type 'g6e.48xlarge' (label node.kubernetes.io/instance-type) is not in the catalog",
        ),
        ({}, None, "has no node.kubernetes.io/instance-type label and no --instance-type was given"),
        (
            {agent.INSTANCE_TYPE_LABEL: "trn2.48xlarge"},
            None,
            "trn2.48xlarge (label node.kubernetes.io/instance-type) is not an NVIDIA GPU instance",
        ),
    ],
)
def test_a_node_of_an_unknown_type_is_not_judged(labels: dict, fallback: str | None, message: str) -> None:
    """No taint, no eviction, no replacement: one Event and a line each round."""
    node = {**NODE, "metadata": {**NODE["metadata"], "labels": labels}}
    kube = RecordingKube(node, [{"metadata": {"name": "serve-0", "namespace": "supernode-train"}}])

    def never(_before: dict | None) -> health.Readings:
        raise AssertionError("an unjudged node's tools are not read")

    w = watch(fallback)
    lines = [w.round(kube, None, never, list, now=1000.0 + i) for i in range(2)]
    assert all(line["action"] == "not_judged" and message in line["reason"] for line in lines)
    writes = [(m, p, b) for m, p, _, b in kube.sent if m != "GET"]
    assert [(m, p) for m, p, _ in writes] == [("POST", "/api/v1/namespaces/default/events")]  # once, not per round
    assert writes[0][2]["reason"] == "NodeNotJudged" and message in writes[0][2]["message"]
    assert mf.validate([writes[0][2]], VERSION) == []


# -- a check that did not run is not a pass (issue 41 items 1 and 2) ---------------------------------


def fake_tools(bin_dir: Path, **scripts: str) -> None:
    """Shell scripts standing in for the node's tools (name -> body), alone on PATH with sh and cat."""
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)


def test_a_refused_dmesg_and_a_missing_dcgmi_are_checks_not_run(tmp_path, monkeypatch) -> None:
    """The trainer image has no dcgmi, and a non-root dmesg under kernel.dmesg_restrict=1 prints its
    error on stderr and exits 1: both once read as "no finding"."""
    tools = tmp_path / "bin"
    fake_tools(
        tools,
        **{
            "nvidia-smi": f'case "$*" in "-q") cat {FIXTURES}/nvidia-smi-q.txt;; "nvlink -s") cat {FIXTURES}/nvlink-s.txt;; '
            f"*) cat {FIXTURES}/ecc-remap-ok.txt;; esac",
            "dmesg": 'echo "dmesg: read kernel buffer failed: Operation not permitted" >&2; exit 1',
        },
    )
    for tool in ("sh", "cat"):
        (tools / tool).symlink_to(Path("/bin") / tool)
    monkeypatch.setenv("PATH", str(tools))
    readings = agent.gather(None)
    assert readings.dmesg is None and readings.dcgmi_health is None and readings.nvidia_smi_q
    assert readings.not_run == {
        "xid": "dmesg exited 1: dmesg: read kernel buffer failed: Operation not permitted",
        "dcgm": "dcgmi is not installed in this image",
    }
    verdict = health.decide(readings, agent.lookup("p5en.48xlarge"))
    # nothing found but this machine's missing EFA devices, and not known healthy
    assert {f.check for f in verdict.findings} == {"efa"} and not verdict.checked
    assert isinstance(agent.deep_check(), agent.NotRun)


def test_a_tool_that_fails_with_output_is_a_reading_and_one_that_hangs_is_not_run(tmp_path) -> None:
    fake_tools(tmp_path, failing="echo '| Overall Health | Failure |'; exit 226", hanging="sleep 5")
    assert agent.run_tool([str(tmp_path / "failing")]) == "| Overall Health | Failure |\n"
    assert agent.run_tool([str(tmp_path / "hanging")], timeout_s=1) == agent.NotRun(
        f"{tmp_path / 'hanging'} timed out after 1 s"
    )


def unchecked_readings(_before: dict | None) -> health.Readings:
    """A healthy p5en whose dmesg was refused and which has no dcgmi."""
    return replace(
        p5en_readings(None),
        dmesg=None,
        dcgmi_health=None,
        not_run={"xid": "dmesg exited 1: Operation not permitted", "dcgm": "dcgmi is not installed in this image"},
    )


def no_dcgmi() -> agent.NotRun:
    return agent.NotRun("dcgmi is not installed in this image")


def test_hold_keeps_a_node_whose_checks_did_not_run_out_and_says_so_once() -> None:
    kube = RecordingKube(labelled(NODE, "p5en.48xlarge"), [])
    w = watch()
    lines = [w.round(kube, None, unchecked_readings, no_dcgmi, now=1000.0 + i) for i in range(3)]
    assert [line["checks_not_run"] for line in lines] == [3, 3, 3]  # xid, dcgm, dcgm_diag
    assert "dcgm_diag: dcgmi is not installed" in lines[0]["not_run"]
    writes = [(m, p, b) for m, p, _, b in kube.sent if m != "GET"]
    # no patch: the node keeps supernode.io/unchecked; one Event, not one per round
    assert [(m, p) for m, p, _ in writes] == [("POST", "/api/v1/namespaces/default/events")]
    event = writes[0][2]
    assert event["reason"] == "NodeChecksNotRun" and "xid: dmesg exited 1" in event["message"]
    assert "--unchecked-nodes hold" in event["message"] and mf.validate([event], VERSION) == []
    # once every tool runs and passes, the node is admitted
    line = w.round(kube, None, p5en_readings, list, now=2000.0)
    assert line["checks_not_run"] == 0 and "not_run" not in line
    patch = kube.sent[-1][3]
    assert taints(patch) == [("nvidia.com/gpu", "true", "NoSchedule")]


def test_admit_lets_the_checks_that_ran_decide_and_still_reports_the_rest() -> None:
    kube = RecordingKube(labelled(NODE, "p5en.48xlarge"), [])
    line = watch(unchecked=agent.ADMIT).round(kube, None, unchecked_readings, no_dcgmi, now=1000.0)
    assert line["checks_not_run"] == 3
    writes = [(m, b) for m, _, _, b in kube.sent if m != "GET"]
    assert [m for m, _ in writes] == ["POST", "PATCH"]
    assert "--unchecked-nodes admit" in writes[0][1]["message"]
    assert taints(writes[1][1]) == [("nvidia.com/gpu", "true", "NoSchedule")]  # admitted


def test_hold_does_not_release_a_quarantined_node_on_rounds_that_could_not_see_its_fault() -> None:
    """Quarantined for an XID; dmesg then refused: those rounds are no passes."""
    kube = RecordingKube(labelled(NODE, "p5en.48xlarge"), [])
    w = watch()
    w.checked = True
    faulty = replace(p5en_readings(None), dmesg=(FIXTURES / "dmesg-xid63.txt").read_text())
    assert w.round(kube, None, lambda _b: faulty, list, now=1000.0)["node_quarantined"] == 1
    for i in range(5):  # more than --release-after 3
        assert w.round(kube, None, unchecked_readings, list, now=1001.0 + i)["node_quarantined"] == 1
    for i in range(3):
        line = w.round(kube, None, p5en_readings, list, now=2000.0 + i)
    assert line["node_quarantined"] == 0 and line["action"] == health.RELEASE
