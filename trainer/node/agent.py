"""The node health agent: check this GPU node, quarantine it, record why, hand broken ones to replacement.

    python -m supernode.trainer.node.agent watch --evict-namespace supernode-train \
        [--instance-type p5.48xlarge] [--fabric-verdict NAMESPACE/NAME --fabric-max-age-s S]

Every `--interval-s` the agent runs the tools supernode.trainer.node.health reads, decides, and acts
on this node (NODE_NAME, from the pod's downward API). The node is judged against the catalog's
figures for its own instance type, its Node's `node.kubernetes.io/instance-type` label (a serving node
group of another type beside training's is judged as itself); `--instance-type` only stands in where
the label is missing. A type the catalog does not know is not judged (a line and one Event, no taint,
no replacement): its GPU count, NVLink and EFA figures are unknown. With `--fabric-verdict` the
fabric re-check's latest verdict on this node (a ConfigMap, health.fabric_verdict) is one of the
readings: a node it named slow is quarantined until a later check measures it and passes; a verdict
older than `--fabric-max-age-s` is ignored.

- a failure taints the node `supernode.io/unhealthy=<check>:NoSchedule`, labels it
  `supernode.io/health=quarantined` with the finding in an annotation, and posts a Kubernetes Event;
- a hardware fault (or repeated failures, health.Tracker) also evicts our pods (the Eviction API,
  so their grace period runs) and terminates the instance in its Auto Scaling group with
  ShouldDecrementDesiredCapacity=False: the group starts a replacement, which joins unchecked;
- a quarantined node that passes `--release-after` rounds in a row is untainted.

A node joins with the `supernode.io/unchecked:NoSchedule` taint (the node group sets it; training
pods do not tolerate it): the agent's first round adds the deep check (`dcgmi diag -r 2`) and
removes that taint only when everything passes.

A check whose tool did not run (not in the image, refused, timed out, or exited with an error and no
output: `run_tool`) is not a pass. Each round's line counts them (`checks_not_run`, which the
`node-checks-not-run` alarm reads), the node gets a `NodeChecksNotRun` Event once per reason, and
`--unchecked-nodes` (the stack's workload.uncheckedNodes) decides the rest: `hold` admits or
releases a node only on a round in which every check ran (it keeps retrying the deep check),
`admit` lets the checks that did run decide.

Each round prints one JSON line; `node_quarantined` (0/1) and `node_replaced` feed the monitoring's
log metric filters and alarms. Exit codes: 0 done (--once), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from supernode.core.catalog import InstanceType, lookup
from supernode.core.errors import EXIT_BAD_INPUT, EXIT_OK, BadInput
from supernode.core.processes import exit_on_sigterm
from supernode.trainer.node import health

UNHEALTHY_TAINT = "supernode.io/unhealthy"
UNCHECKED_TAINT = "supernode.io/unchecked"
HEALTH_LABEL = "supernode.io/health"
REASON_ANNOTATION = "supernode.io/health-reason"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"  # the kubelet's, from the cloud provider
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


class NotJudged(Exception):
    """The node's instance type is not one the checks have figures for."""


def judged_as(node: dict[str, Any], fallback: str | None) -> InstanceType:
    """The catalog row the node is judged against: its own instance-type label, else `fallback`
    (--instance-type). NotJudged names the type and where it came from when there is none."""
    name = node["metadata"]["name"]
    kind = node["metadata"].get("labels", {}).get(INSTANCE_TYPE_LABEL)
    source = f"label {INSTANCE_TYPE_LABEL}"
    if not kind:
        if fallback is None:
            raise NotJudged(f"node {name} has no {INSTANCE_TYPE_LABEL} label and no --instance-type was given")
        kind, source = fallback, "--instance-type"
    try:
        instance = lookup(kind)
    except KeyError:
        raise NotJudged(
            f"node {name}: instance type {kind!r} ({source}) is not in the catalog: no GPU count, NVLink or "
            "EFA figures to judge it against, so it is neither quarantined nor replaced"
        ) from None
    if not instance.vendor_row.node_agent:  # the checks read NVIDIA's tools (Neuron nodes: not yet)
        raise NotJudged(f"node {name}: {kind} ({source}) is not an NVIDIA GPU instance: the checks read NVIDIA tools")
    return instance


def replace_instance(autoscaling: Any, instance: str) -> dict[str, Any]:
    """Terminate the instance in its Auto Scaling group without lowering the desired capacity, so
    the group launches a replacement. `autoscaling` is a boto3 client; IAM allows this call only on
    the stack's GPU groups."""
    answer = autoscaling.terminate_instance_in_auto_scaling_group(
        InstanceId=instance, ShouldDecrementDesiredCapacity=False
    )
    return answer["Activity"]


# -- running the tools -----------------------------------------------------------------------------


HOLD, ADMIT = "hold", "admit"  # --unchecked-nodes: what a check that did not run does to admission


@dataclass(frozen=True)
class NotRun:
    """A tool that gave no reading, and why (a check that did not run is not a pass)."""

    why: str


def run_tool(argv: list[str], timeout_s: int = 120) -> str | NotRun:
    """The tool's output, or why there is none. A non-zero exit with output is a reading (dcgmi
    exits non-zero on the failures it prints); one without output is a tool that did not run (`dmesg`
    refused by kernel.dmesg_restrict prints its error on stderr only)."""
    cmd = shlex.join(argv)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return NotRun(f"{argv[0]} is not installed in this image")
    except OSError as e:
        return NotRun(f"{cmd} could not start: {e.strerror or e}")
    except subprocess.TimeoutExpired:
        return NotRun(f"{cmd} timed out after {timeout_s} s")
    if done.returncode != 0 and not done.stdout.strip():
        said = (done.stderr.strip().splitlines() or ["no output"])[-1].strip()[:200]
        return NotRun(f"{cmd} exited {done.returncode}: {said}")
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


# Each round's tools: the Readings field each fills, the check it serves, the command.
ROUND_TOOLS = (
    ("nvidia_smi_q", "gpu_count", ["nvidia-smi", "-q"]),
    ("nvlink_status", "nvlink", ["nvidia-smi", "nvlink", "-s"]),
    ("dmesg", "xid", ["dmesg"]),
    ("ecc_remap", "ecc", ["nvidia-smi", "-q", "-d", "ECC,ROW_REMAPPER"]),
    ("dcgmi_health", "dcgm", ["dcgmi", "health", "-c"]),
)


def gather(efa_before: dict[str, dict[str, int]] | None) -> health.Readings:
    readings: dict[str, str] = {}
    not_run: dict[str, str] = {}
    for field_name, check, argv in ROUND_TOOLS:
        result = run_tool(argv)
        if isinstance(result, NotRun):
            not_run[check] = result.why
        else:
            readings[field_name] = result
    return health.Readings(**readings, efa_before=efa_before, efa_now=read_efa_counters(), not_run=not_run)


# -- the loop --------------------------------------------------------------------------------------


class Kube:
    """The few API calls the agents' RBAC allows: get/patch nodes, list pods, create evictions and
    events, get (the node agent) or patch (the fabric re-check) the fabric verdict ConfigMap."""

    def __init__(self) -> None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise BadInput("the Kubernetes API is reached from a pod: KUBERNETES_SERVICE_HOST is not set")
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

    def configmap(self, namespace: str, name: str) -> dict:
        return self.call("GET", f"/api/v1/namespaces/{namespace}/configmaps/{name}")

    def patch_configmap(self, body: dict) -> dict:
        meta = body["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/configmaps/{meta['name']}"
        return self.call("PATCH", path, body, "application/merge-patch+json")


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


def deep_check() -> list[str] | NotRun:
    """`dcgmi diag -r 2`'s failed tests (minutes: run once, when the node joins), or why it did not run."""
    result = run_tool(["dcgmi", "diag", "-r", "2"], timeout_s=1800)
    return result if isinstance(result, NotRun) else parse_dcgmi_diag(result)


@dataclass
class Watch:
    """One node's agent between rounds: what it carries from one round to the next."""

    node_name: str
    fallback: str | None  # --instance-type: only where the node has no instance-type label
    namespaces: list[str]
    tracker: health.Tracker
    fabric_configmap: tuple[str, str] | None = None  # (namespace, name) of the fabric verdict
    fabric_max_age_s: float = 0.0
    efa_before: dict[str, dict[str, int]] | None = None
    checked: bool = False
    fabric_entries: dict[str, str] | None = None  # the last verdict read: a failed read keeps it (it ages)
    not_judged: str = ""  # the reason last posted as an Event: one Event per reason, not one per round
    unchecked: str = HOLD  # --unchecked-nodes
    not_run_posted: str = ""  # the checks-not-run detail last posted as an Event

    def read_fabric(self, kube: Kube, now: float) -> tuple[bool | None, str]:
        if self.fabric_configmap is None:
            return None, "not read"
        unread = ""
        try:
            self.fabric_entries = kube.configmap(*self.fabric_configmap).get("data") or {}
        except (OSError, ValueError) as e:
            unread = f" (last read; this one failed: {e})"
        suspect, state = health.fabric_verdict(self.fabric_entries, self.node_name, now, self.fabric_max_age_s)
        return suspect, state + unread

    def round(
        self,
        kube: Kube,
        autoscaling: Any,
        gather_readings: Callable[[dict[str, dict[str, int]] | None], health.Readings],
        diag: Callable[[], list[str] | NotRun],
        now: float,
    ) -> dict[str, Any]:
        """Read, decide and act once; the round's JSON line."""
        node = kube.node(self.node_name)
        try:
            instance = judged_as(node, self.fallback)
        except NotJudged as e:
            if str(e) != self.not_judged:
                kube.post_event(event(node, "NodeNotJudged", str(e), datetime.fromtimestamp(now, UTC)))
                self.not_judged = str(e)
            return {
                "node": self.node_name,
                "action": "not_judged",
                "reason": str(e),
                "node_quarantined": int(self.tracker.quarantined),
            }
        self.not_judged = ""
        suspect, fabric_state = self.read_fabric(kube, now)
        readings = replace(gather_readings(self.efa_before), fabric_suspect=suspect)
        self.efa_before = dict(readings.efa_now or {})
        verdict = health.decide(readings, instance)
        if not self.checked:  # the deep check, before training pods may land here (retried until it runs)
            failed = diag()
            if isinstance(failed, NotRun):
                verdict = replace(verdict, not_run=(*verdict.not_run, ("dcgm_diag", failed.why)))
            elif failed:
                finding = health.Finding("dcgm_diag", health.HARDWARE, "failed: " + ", ".join(failed))
                verdict = replace(verdict, findings=(*verdict.findings, finding))
            self.checked = verdict.severity == health.OK and (verdict.checked or self.unchecked == ADMIT)
        unchecked = verdict.not_run_detail
        if unchecked and unchecked != self.not_run_posted:
            policy = (
                "admitted on the checks that ran (--unchecked-nodes admit)"
                if self.unchecked == ADMIT
                else "not admitted or released until every check runs (--unchecked-nodes hold)"
            )
            kube.post_event(event(node, "NodeChecksNotRun", f"{unchecked}; {policy}", datetime.fromtimestamp(now, UTC)))
        self.not_run_posted = unchecked
        # hold: a round with a check that did not run is neither a pass nor a failure
        held = self.unchecked == HOLD and not verdict.checked and verdict.severity == health.OK
        action = health.STAY if held else self.tracker.observe(verdict, now)
        line = act(
            kube, autoscaling, self.node_name, action, verdict, self.namespaces, self.checked, self.tracker.quarantined
        )
        line.update(
            instance_type=instance.name,
            fabric=fabric_state,
            node_quarantined=int(self.tracker.quarantined),
            checks_not_run=len(verdict.not_run),
        )
        if unchecked:
            line["not_run"] = unchecked
        return line


def configmap_ref(flag: str) -> Callable[[str], tuple[str, str]]:
    """An argparse type for `flag`: NAMESPACE/NAME of a ConfigMap."""

    def parse(text: str) -> tuple[str, str]:
        namespace, _, name = text.partition("/")
        if not namespace or not name or "/" in name:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: give NAMESPACE/NAME of a ConfigMap")
        return namespace, name

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m supernode.trainer.node.agent", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="check this node every --interval-s and act (the DaemonSet)")
    w.add_argument(
        "--instance-type",
        help="judge the node as this type only where its Node has no node.kubernetes.io/instance-type label",
    )
    w.add_argument("--evict-namespace", action="append", default=[], help="namespace whose pods leave a broken node")
    w.add_argument("--interval-s", type=int, default=300)
    w.add_argument("--release-after", type=int, default=3, help="consecutive passes before a quarantine ends")
    w.add_argument("--replace-after", type=int, default=3, help="failures within --window-s that mean replacement")
    w.add_argument("--window-s", type=int, default=86400)
    w.add_argument(
        "--fabric-verdict",
        type=configmap_ref("--fabric-verdict"),
        metavar="NAMESPACE/NAME",
        help="the ConfigMap the fabric re-check writes its verdict on each node to",
    )
    w.add_argument(
        "--fabric-max-age-s",
        type=float,
        help="ignore a fabric verdict older than this (the stack: two fabric-check intervals)",
    )
    w.add_argument(
        "--unchecked-nodes",
        choices=(HOLD, ADMIT),
        default=HOLD,
        help="hold: admit or release a node only on rounds in which every check ran; admit: on the checks that ran",
    )
    w.add_argument("--once", action="store_true", help="one round, then exit")
    return p


def checked_tracker(args: argparse.Namespace) -> health.Tracker:
    """The flags checked (a BadInput otherwise); the quarantine tracker they configure."""
    if args.instance_type is not None:  # a fallback that could never judge a node is a typo: say so now
        try:
            instance = lookup(args.instance_type)
        except KeyError as e:
            raise BadInput(f"--instance-type: {e.args[0]}") from None
        if not instance.vendor_row.node_agent:
            raise BadInput(f"--instance-type: {instance.name} is not an NVIDIA GPU instance")
    if args.interval_s < 30:
        raise BadInput(f"--interval-s must be at least 30, got {args.interval_s}")
    if (args.fabric_verdict is None) != (args.fabric_max_age_s is None):
        raise BadInput("--fabric-verdict and --fabric-max-age-s go together: give both or neither")
    if args.fabric_max_age_s is not None and args.fabric_max_age_s <= 0:
        raise BadInput(f"--fabric-max-age-s must be positive, got {args.fabric_max_age_s:g}")
    try:
        return health.Tracker(args.release_after, args.replace_after, args.window_s)
    except ValueError as e:
        raise BadInput(f"--{str(e).replace('_', '-')}") from None


def watch_node(args: argparse.Namespace, tracker: health.Tracker) -> int:
    """Check and act on this node every --interval-s (one round with --once). A BadInput (the pod
    lacks what the DaemonSet gives it: NODE_NAME, the Kubernetes API) ends it; other errors of a
    round are printed and the next round retries."""
    node_name = os.environ.get("NODE_NAME") or ""
    if not node_name:
        raise BadInput("NODE_NAME is not set (the DaemonSet sets it from spec.nodeName)")
    kube = Kube()
    import boto3  # the trainer image has it; a failing import is a broken image, not bad input
    from botocore.exceptions import BotoCoreError, ClientError

    autoscaling = boto3.client("autoscaling")
    watch = Watch(
        node_name,
        args.instance_type,
        args.evict_namespace,
        tracker,
        args.fabric_verdict,
        args.fabric_max_age_s or 0.0,
        unchecked=args.unchecked_nodes,
    )
    exit_on_sigterm()
    while True:
        try:
            line = watch.round(kube, autoscaling, gather, deep_check, time.time())
            print(json.dumps(line, sort_keys=True), flush=True)
        except (OSError, ValueError, KeyError, BotoCoreError, ClientError) as e:  # next round retries
            print(json.dumps({"node": node_name, "agent": "error", "error": str(e)}), flush=True)
        if args.once:
            return EXIT_OK
        time.sleep(args.interval_s)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return EXIT_BAD_INPUT if e.code else EXIT_OK
    try:
        return watch_node(args, checked_tracker(args))
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
