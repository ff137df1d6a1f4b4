"""Serving policies (issue 17): checklist item 7 made mandatory for serving workloads, availability,
exposure and fit of the inference plan. Serving workloads are the Deployments / LeaderWorkerSets
labelled `app.kubernetes.io/component: serving` (components/k8s/serving.py)."""

from __future__ import annotations

from typing import Any

from supernode.core.resource_types import DEPLOYMENT, K8S_SERVICE, LEADER_WORKER_SET, NETWORK_POLICY, PDB
from supernode.core.serving import MODELS_DIR, VERIFY_CONTAINER

from .base import Registry, Report
from .view import Res, Stack, get, items, pod_templates

POLICIES = Registry()

COMPONENT = "app.kubernetes.io/component"
OPEN_CIDRS = ("0.0.0.0/0", "::/0")
LWS_LABEL_PREFIX = "leaderworkerset.sigs.k8s.io/"


def serving_workloads(stack: Stack) -> list[Res]:
    return [r for r in stack.of(DEPLOYMENT, LEADER_WORKER_SET) if r.get("metadata", "labels", COMPONENT) == "serving"]


def _pod_labels(res: Res) -> dict:
    return dict(get(pod_templates(res)[0], "metadata", "labels", default={}) or {}) if pod_templates(res) else {}


def _selects(selector: Any, labels: dict) -> bool:
    match = get(selector, "matchLabels", default={}) or {}
    return bool(match) and all(labels.get(k) == v for k, v in dict(match).items())


@POLICIES.stack(
    "serving-weights-verified",
    7,
    "Serving pods start only on weights verified by sha256 against the export's manifest.",
)
def _weights_verified(stack: Stack, _conf: None, report: Report) -> None:
    for res in serving_workloads(stack):
        for template in pod_templates(res):
            spec = get(template, "spec", default={})
            inits = [c for c in items(get(spec, "initContainers")) if get(c, "name") == VERIFY_CONTAINER]
            servers = items(get(spec, "containers"))
            reads_verified = all(
                any(get(m, "mountPath") == MODELS_DIR for m in items(get(c, "volumeMounts")))
                and MODELS_DIR in items(get(c, "args"))
                for c in servers
            )
            if not inits or not reads_verified:
                report(
                    res,
                    f"{res.label} starts its server without weights verified by digest: it needs the "
                    f"'{VERIFY_CONTAINER}' init container (copies the export and checks every file's sha256 "
                    f"against manifest.json) and must serve only the verified copy at {MODELS_DIR}. "
                    "Fix: deploy serving through components/k8s/serving.py.",
                )


@POLICIES.stack("serving-availability", 9, "Serving has a PodDisruptionBudget, and at least 2 replicas in prod.")
def _availability(stack: Stack, _conf: None, report: Report) -> None:
    plan = stack.plan()
    pdbs = stack.of(PDB)
    for res in serving_workloads(stack):
        labels = _pod_labels(res)
        if not any(_selects(p.get("spec", "selector"), labels) for p in pdbs):
            report(
                res,
                f"{res.label} has no PodDisruptionBudget: a node drain may take every replica at once. "
                "Fix: a PDB selecting its pods (maxUnavailable 1).",
            )
        replicas = int(res.get("spec", "replicas", default=1) or 0)  # numbers arrive as floats from the engine
        if plan is not None and plan.stack == "prod" and replicas < 2:
            report(
                res,
                f"{res.label} runs {replicas} replica(s) in prod: one failure takes serving down. "
                "Fix: supernode:inference.replicasMin >= 2.",
            )


@POLICIES.stack(
    "serving-not-public", 10, "No serving endpoint is open to the world (ClusterIP, NetworkPolicy with listed clients)."
)
def _not_public(stack: Stack, _conf: None, report: Report) -> None:
    workloads = serving_workloads(stack)
    labels = [_pod_labels(r) for r in workloads]
    for svc in stack.of(K8S_SERVICE):
        # A LeaderWorkerSet's leaders are selected by a label its controller adds (not in the template).
        selector = {
            k: v
            for k, v in dict(svc.get("spec", "selector", default={}) or {}).items()
            if not k.startswith(LWS_LABEL_PREFIX)
        }
        if any(_selects({"matchLabels": selector}, lab) for lab in labels) and svc.get(
            "spec", "type", default="ClusterIP"
        ) in ("LoadBalancer", "NodePort"):
            report(
                svc,
                f"{svc.label} exposes the serving endpoint as {svc.get('spec', 'type')}: open beyond the "
                "cluster. Fix: ClusterIP behind the organisation's gateway (inference.allowedClientNamespaces).",
            )
    policies = stack.of(NETWORK_POLICY)
    for res, lab in zip(workloads, labels):
        mine = [p for p in policies if _selects(p.get("spec", "podSelector"), lab)]
        if not mine:
            report(
                res,
                f"{res.label} has no NetworkPolicy: any pod in the cluster may call the server. "
                "Fix: a policy admitting only inference.allowedClientNamespaces.",
            )
        for p in mine:
            for rule in items(p.get("spec", "ingress")):
                sources = items(get(rule, "from"))
                if (
                    not sources
                    or any(get(s, "ipBlock", "cidr") in OPEN_CIDRS for s in sources)
                    or any(
                        get(s, "namespaceSelector") is not None
                        and not get(s, "namespaceSelector")
                        and get(s, "podSelector") is None
                        for s in sources
                    )
                ):
                    report(
                        p,
                        f"{p.label} admits every source to the serving pods ({rule}): the endpoint is open to "
                        "the world. Fix: list the client namespaces (inference.allowedClientNamespaces).",
                    )


@POLICIES.stack("serving-plan-fits", 2, "The inference plan (weights + KV cache + runtime) fits the usable HBM.")
def _fits(stack: Stack, _conf: None, report: Report) -> None:
    plan = stack.plan()
    ip = plan.inference if plan else None
    if ip is not None and not ip.fits:
        hint = (
            f"use inference.tp {ip.suggested_tp}"
            if ip.suggested_tp
            else "no tensor-parallel degree within a node fits: raise inference.pp, or lower maxSeqLen/maxConcurrency"
        )
        report(
            stack.plan_config_map(),
            f"the inference plan needs {ip.memory_per_gpu_gib:.1f} GiB per GPU (weights "
            f"{ip.weights_per_gpu_gib:.1f} + KV cache {ip.kv_per_gpu_gib:.1f} + runtime {ip.overhead_per_gpu_gib:.1f}), "  # noqa: E501
            f"over the usable {ip.usable_hbm_gib:.1f} GiB by {ip.over_by_gib:.1f} GiB. Fix: {hint}.",
        )


@POLICIES.stack(
    "serving-plan-meets-targets",
    2,
    "The inference plan's estimates meet the stack's p99 TTFT and ITL targets (inference.ttftTargetMs, itlTargetMs).",
)
def _meets_targets(stack: Stack, _conf: None, report: Report) -> None:
    """The Plan's figures (supernode/core/inference.py) judged against its targets; a target left unset
    judges nothing. Memory is serving-plan-fits' finding, so a layout that misses both is named twice."""
    plan = stack.plan()
    ip = plan.inference if plan else None
    if ip is None:
        return
    missed = [
        f"{what} estimate {estimate:.1f} ms over the {target:g} ms target (inference.{key})"
        for what, estimate, target, meets, key in (
            ("TTFT", ip.ttft_ms, ip.ttft_target_ms, ip.meets_ttft_target, "ttftTargetMs"),
            ("ITL", ip.itl_ms, ip.itl_target_ms, ip.meets_itl_target, "itlTargetMs"),
        )
        if meets is False
    ]
    if missed:
        better = [a.label for a in ip.alternatives if a.meets_targets]
        hint = (
            f"a layout that meets them: {', '.join(better)} (inference.layout / tp / pp)"
            if better
            else "no layout the planner weighed meets them: lower maxSeqLen or maxConcurrency, or relax the target"
        )
        report(
            stack.plan_config_map(),
            f"the inference plan ({ip.layout}: tp {ip.tp} x pp {ip.pp} x dp {ip.dp}, {ip.max_concurrency} "
            f"sequences at {ip.max_seq_len} tokens on {ip.instance_type}) misses its latency targets: "
            + "; ".join(missed)
            + f". Fix: {hint}.",
        )
