"""The node health agent: check this GPU node, quarantine it, record why, hand broken ones to replacement.

    python -m supernode.trainer.node.agent watch --instance-type p5.48xlarge --evict-namespace supernode-train

Every `--interval-s` the agent runs the tools supernode.trainer.node.health reads, decides, and acts
on this node (NODE_NAME, from the pod's downward API):

- a failure taints the node `supernode.io/unhealthy=<check>:NoSchedule`, labels it
  `supernode.io/health=quarantined` with the finding in an annotation, and posts a Kubernetes Event;
- a hardware fault (or repeated failures, health.Tracker) also evicts our pods (the Eviction API,
  so their grace period runs) and terminates the instance in its Auto Scaling group with
  ShouldDecrementDesiredCapacity=False: the group starts a replacement, which joins unchecked;
- a quarantined node that passes `--release-after` rounds in a row is untainted.

A node joins with the `supernode.io/unchecked:NoSchedule` taint (the node group sets it; training
pods do not tolerate it): the agent's first round adds the deep check (`dcgmi diag -r 2`) and
removes that taint only when everything passes.

Each round prints one JSON line; `node_quarantined` (0/1) and `node_replaced` feed the monitoring's
log metric filters and alarms. Exit codes: 0 done (--once), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from supernode.core.catalog import lookup
from supernode.core.errors import EXIT_BAD_INPUT, EXIT_OK, BadInput
from supernode.trainer.node import health

UNHEALTHY_TAINT = "supernode.io/unhealthy"
UNCHECKED_TAINT = "supernode.io/unchecked"
HEALTH_LABEL = "supernode.io/health"
REASON_ANNOTATION = "supernode.io/health-reason"
COMPONENT = "supernode-node-agent"
EFA_COUNTERS = Path("/sys/class/infiniband")
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


# -- the Kubernetes API request bodies (tests validate them against the API schemas) ---------------


def _ours(taint: dict[str, Any]) -> bool:
    return taint["key"] in (UNHEALTHY_TAINT, UNCHECKED_TAINT)


def node_patch(node: dict[str, Any], state: str, reason: str, detail: str, *, checked: bool) -> dict[str, Any]:
    """A JSON merge patch (application/merge-patch+json) for the Node: the whole taint list, since a
    merge patch replaces lists: other owners' taints kept, ours set from `state` (ok, quarantined,
    replacing) and `checked` (the deep check passed). `resourceVersion` makes a concurrent change to
    the node fail the patch (409) rather than be overwritten; the next round retries."""
    taints = [t for t in node.get("spec", {}).get("taints", []) if not _ours(t)]
    if not checked:
        taints.append({"key": UNCHECKED_TAINT, "effect": "NoSchedule"})
    if state != "ok":
        taints.append({"key": UNHEALTHY_TAINT, "value": reason, "effect": "NoSchedule"})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node["metadata"]["name"],
            "resourceVersion": node["metadata"]["resourceVersion"],
            "labels": {HEALTH_LABEL: state},
            "annotations": {REASON_ANNOTATION: detail[:1000]},
        },
        "spec": {"taints": taints},
    }


def eviction(pod: dict[str, Any]) -> dict[str, Any]:
    """The body of POST /api/v1/namespaces/<ns>/pods/<name>/eviction."""
    meta = pod["metadata"]
    return {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
    }


def event(node: dict[str, Any], reason: str, message: str, now: datetime) -> dict[str, Any]:
    """A core/v1 Warning Event on the Node (nodes are cluster-scoped: events about them live in `default`)."""
    name = node["metadata"]["name"]
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.{uuid.uuid4().hex[:12]}", "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"].get("uid", "")},
        "reason": reason,
        "message": message[:1000],
        "type": "Warning",
        "source": {"component": COMPONENT, "host": name},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def instance_id(node: dict[str, Any]) -> str:
    """The EC2 instance id from `spec.providerID` (aws:///us-east-1a/i-0123456789abcdef0)."""
    provider = node.get("spec", {}).get("providerID", "")
    m = re.search(r"(i-[0-9a-f]+)$", provider)
    if not m:
        raise BadInput(f"node {node['metadata']['name']}: spec.providerID {provider!r} names no EC2 instance")
    return m.group(1)


def replace_instance(autoscaling: Any, instance: str) -> dict[str, Any]:
    """Terminate the instance in its Auto Scaling group without lowering the desired capacity, so
    the group launches a replacement. `autoscaling` is a boto3 client; IAM allows this call only on
    the stack's GPU groups."""
    answer = autoscaling.terminate_instance_in_auto_scaling_group(
        InstanceId=instance, ShouldDecrementDesiredCapacity=False
    )
    return answer["Activity"]


# -- running the tools -----------------------------------------------------------------------------


def _run(argv: list[str], timeout_s: int = 120) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout


def read_efa_counters(root: Path = EFA_COUNTERS) -> dict[str, dict[str, int]]:
    """Every EFA device's port-1 hardware counters (cumulative since boot)."""
    out: dict[str, dict[str, int]] = {}
    for counters in sorted(root.glob("*/ports/1/hw_counters")):
        device = counters.parents[2].name
        out[device] = {}
        for f in counters.iterdir():
            value = f.read_text().strip()
            if value.isdigit():
                out[device][f.name] = int(value)
    return out


def parse_dcgmi_diag(text: str) -> list[str]:
    """`dcgmi diag -r 2`: the names of the tests whose result cell says Fail."""
    failed = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[1].startswith("Fail"):
            failed.append(cells[0])
    return failed


def gather(efa_before: dict[str, dict[str, int]] | None) -> health.Readings:
    return health.Readings(
        nvidia_smi_q=_run(["nvidia-smi", "-q"]),
        nvlink_status=_run(["nvidia-smi", "nvlink", "-s"]),
        dmesg=_run(["dmesg"]),
        ecc_remap=_run(["nvidia-smi", "-q", "-d", "ECC,ROW_REMAPPER"]),
        dcgmi_health=_run(["dcgmi", "health", "-c"]),
        efa_before=efa_before,
        efa_now=read_efa_counters(),
    )


# -- the loop --------------------------------------------------------------------------------------


class Kube:
    """The few API calls the agent's RBAC allows: get/patch nodes, list pods, create evictions and events."""

    def __init__(self) -> None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise BadInput("watch runs in a pod: KUBERNETES_SERVICE_HOST is not set")
        self.base = f"https://{host}:{port}"
        self.token = (SA_DIR / "token").read_text(encoding="utf-8").strip()
        self.tls = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))

    def call(self, method: str, path: str, body: dict | None = None, content_type: str = "application/json") -> dict:
        req = urllib.request.Request(
            self.base + path,
            method=method,
            data=json.dumps(body).encode() if body else None,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type},
        )
        with urllib.request.urlopen(req, context=self.tls, timeout=30) as resp:
            return json.loads(resp.read())

    def node(self, name: str) -> dict:
        return self.call("GET", f"/api/v1/nodes/{name}")

    def patch_node(self, body: dict) -> dict:
        return self.call("PATCH", f"/api/v1/nodes/{body['metadata']['name']}", body, "application/merge-patch+json")

    def pods_on(self, node: str, namespace: str) -> list[dict]:
        query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}"})
        return self.call("GET", f"/api/v1/namespaces/{namespace}/pods?{query}")["items"]

    def evict(self, pod: dict) -> None:
        meta = pod["metadata"]
        self.call("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/eviction", eviction(pod))

    def post_event(self, body: dict) -> None:
        self.call("POST", "/api/v1/namespaces/default/events", body)


def act(
    kube: Kube,
    autoscaling: Any,
    node_name: str,
    action: str,
    verdict: health.Verdict,
    namespaces: list[str],
    checked: bool,
    quarantined: bool,
) -> dict[str, Any]:
    """Carry out one round's action on the node (`quarantined`: the tracker's state after this
    round); the JSON line's fields."""
    node = kube.node(node_name)
    detail = "; ".join(f"{f.check}: {f.detail}" for f in verdict.findings)
    line: dict[str, Any] = {"node": node_name, "action": action, "severity": verdict.severity, "findings": detail}
    if action == health.EVICT_AND_REPLACE:
        kube.patch_node(node_patch(node, "replacing", verdict.reason, detail, checked=checked))
        kube.post_event(event(node, "NodeReplacing", detail, datetime.now(UTC)))
        for namespace in namespaces:
            for pod in kube.pods_on(node_name, namespace):
                kube.evict(pod)
        line["replacement_activity"] = replace_instance(autoscaling, instance_id(node))["ActivityId"]
        line["node_replaced"] = 1
    elif action == health.QUARANTINE:
        kube.patch_node(node_patch(node, "quarantined", verdict.reason, detail, checked=checked))
        kube.post_event(event(node, "NodeQuarantined", detail, datetime.now(UTC)))
    elif action == health.RELEASE or (
        # the deep check just passed on a node not otherwise held back: admit it
        checked and not quarantined and any(t["key"] == UNCHECKED_TAINT for t in node["spec"].get("taints", []))
    ):
        kube.patch_node(node_patch(node, "ok", "", "", checked=checked))
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supernode.trainer.node.agent", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="check this node every --interval-s and act (the DaemonSet)")
    w.add_argument("--instance-type", required=True, help="the node group's instance type (catalog figures)")
    w.add_argument("--evict-namespace", action="append", default=[], help="namespace whose pods leave a broken node")
    w.add_argument("--interval-s", type=int, default=300)
    w.add_argument("--release-after", type=int, default=3, help="consecutive passes before a quarantine ends")
    w.add_argument("--replace-after", type=int, default=3, help="failures within --window-s that mean replacement")
    w.add_argument("--window-s", type=int, default=86400)
    w.add_argument("--once", action="store_true", help="one round, then exit")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return EXIT_BAD_INPUT if e.code else EXIT_OK
    try:
        try:
            instance = lookup(args.instance_type)
        except KeyError as e:
            raise BadInput(f"--instance-type: {e.args[0]}") from None
        if instance.vendor != "nvidia":  # the checks read NVIDIA's tools (Neuron nodes: not yet)
            raise BadInput(f"--instance-type: {instance.name} is not an NVIDIA GPU instance")
        if args.interval_s < 30:
            raise BadInput(f"--interval-s must be at least 30, got {args.interval_s}")
        try:
            tracker = health.Tracker(args.release_after, args.replace_after, args.window_s)
        except ValueError as e:
            raise BadInput(f"--{str(e).replace('_', '-')}") from None
        node_name = os.environ.get("NODE_NAME") or ""
        if not node_name:
            raise BadInput("NODE_NAME is not set (the DaemonSet sets it from spec.nodeName)")
        kube = Kube()
        import boto3  # the trainer image has it; a failing import is a broken image, not bad input
        from botocore.exceptions import BotoCoreError, ClientError

        autoscaling = boto3.client("autoscaling")
        efa_before: dict[str, dict[str, int]] | None = None
        checked = False
        while True:
            try:
                readings = gather(efa_before)
                efa_before = dict(readings.efa_now or {})
                verdict = health.decide(readings, instance)
                if not checked:  # the deep check, once, before training pods may land here
                    failed = parse_dcgmi_diag(_run(["dcgmi", "diag", "-r", "2"], timeout_s=1800) or "")
                    if failed:
                        finding = health.Finding("dcgm_diag", health.HARDWARE, "failed: " + ", ".join(failed))
                        verdict = health.Verdict((*verdict.findings, finding))
                    checked = verdict.severity == health.OK
                action = tracker.observe(verdict, time.time())
                line = act(
                    kube, autoscaling, node_name, action, verdict, args.evict_namespace, checked, tracker.quarantined
                )
                line["node_quarantined"] = int(tracker.quarantined)
                print(json.dumps(line, sort_keys=True), flush=True)
            except (OSError, ValueError, KeyError, BotoCoreError, ClientError) as e:  # next round retries
                print(json.dumps({"node": node_name, "agent": "error", "error": str(e)}), flush=True)
            if args.once:
                return EXIT_OK
            time.sleep(args.interval_s)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
