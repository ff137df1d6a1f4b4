"""Alarms carry the configured thresholds and notify the encrypted SNS topic; log groups are
retained and encrypted; metric filters catch NCCL timeouts, OOM and XID errors; a dashboard."""

from __future__ import annotations

import json
import re

from aws_preview import Stack, insights_query

from supernode.core import observability as obs
from supernode.core import resource_types as T
from supernode.core import teams as team_names
from supernode.core.catalog import GIB
from supernode.core.plan import build_plan

ALARM = T.METRIC_ALARM
LOG_GROUP = T.LOG_GROUP


def alarms(stack: Stack) -> dict[str, dict]:
    return {r.inputs["name"].removeprefix(f"supernode-{stack.result.stack}-"): r.inputs for r in stack.all(ALARM)}


def training_queues(stack: Stack) -> list[str]:
    names = [r.inputs["metadata"]["name"] for r in stack.all(T.CLUSTER_QUEUE)]
    return [n for n in names if obs.is_training_queue(n)]


def served_namespaces(stack: Stack) -> list[str]:
    """The namespaces whose jobs queue for training: the stack's, and each team's (prod has two)."""
    return [stack.cfg.workload.namespace, *(team_names.namespace(t.name) for t in stack.cfg.teams)]


def serving_alarms(stack: Stack) -> list[str]:
    ip = build_plan(stack.result.stack, stack.cfg).inference
    if ip is None:
        return []
    model = f"{stack.result.stack}-vllm"  # the served model's name (components/k8s/serving.py serving_app)
    targets = {
        "ttft": ip.ttft_target_ms,
        "itl": ip.itl_target_ms,
        "errors": stack.cfg.monitoring.serving_error_rate_max,
    }
    return [obs.serving_slo_alarm(purpose, model) for purpose, target in targets.items() if target is not None]


def test_every_alarm_notifies_the_topic(stack: Stack):
    topic = stack.outputs["sns_topic_arn"]
    found = alarms(stack)
    assert set(found) == {
        "gpu-util-low",
        "node-not-ready",
        "gpu-xid-errors",
        "nccl-timeouts",
        "out-of-memory",
        "fsx-free-capacity-low",
        # training health and operations (issue 18; tests/components/test_training_health.py)
        "training-step-stalled",
        "training-throughput-low",
        "training-plan-drift",
        "training-loss-not-finite",
        "checkpoint-stale",
        "training-restarts",
        "fabric-regressed",
        "inventory-drift",
        "restore-drill-failed",
        # node health (issue 26 item 4; tests/components/test_node_agent.py)
        "node-quarantined",
        "node-replaced",
        "node-checks-not-run",
        "gpu-ecc-uncorrectable",
        "gpu-row-remap-failure",
        "gpu-pcie-replays",
        # the accelerator exporter itself (issue 27; tests/components/test_trn2_monitoring.py)
        "gpu-exporter-absent",
        # each training queue's wait and its namespace's job failures (issue 36; test_queue_metrics.py)
        *(obs.queue_wait_alarm(cq) for cq in training_queues(stack)),
        *(obs.job_failure_alarm(ns) for ns in served_namespaces(stack)),
        # the served model's SLOs: a latency alarm per target the stack sets, and its error rate (issue 38
        # item 4; tests/components/test_serving_slo_metrics.py)
        *serving_alarms(stack),
    }
    for a in found.values():
        assert a["alarmActions"] == [topic] and a["okActions"] == [topic]
    assert sorted(stack.outputs["alarm_names"]) == sorted(a["name"] for a in found.values())


def test_gpu_utilisation_alarm_uses_floor_and_window(stack: Stack):
    m = stack.cfg.monitoring
    a = alarms(stack)["gpu-util-low"]
    [query] = a["metricQueries"]
    # our DCGM exporter's field, scraped by the CloudWatch agent (the one GPU exporter, issue 18 item 7)
    q = insights_query(query["expression"])
    assert (q["namespace"], q["metric"]) == ("ContainerInsights/Prometheus", "DCGM_FI_DEV_GPU_UTIL")
    assert q["where"] == {"ClusterName": stack.outputs["cluster_name"], "job": "dcgm-exporter"}
    assert a["threshold"] == m.gpu_util_floor_percent and a["comparisonOperator"] == "LessThanThreshold"
    assert query["period"] * a["evaluationPeriods"] == m.gpu_util_window_minutes * 60
    assert a["datapointsToAlarm"] == a["evaluationPeriods"]  # below the floor for the whole window


def test_gpu_utilisation_alarm_watches_each_node(stack: Stack):
    """One idle node of 16 moves a cluster mean by 6%: the alarm evaluates each node's series on its
    own (a multi-time-series Metrics Insights alarm, a contributor per node), the lowest first, and the
    series it reads are per node in the scrape's metric declaration (issue 41 item 4)."""
    a = alarms(stack)["gpu-util-low"]
    [query] = a["metricQueries"]
    q = insights_query(query["expression"])
    assert query["returnData"] is True and "namespace" not in a and "metricName" not in a
    assert q["stat"] == "AVG" and q["group_by"] == ["Hostname"]  # per node, not the cluster's mean
    assert query["expression"].endswith("ORDER BY AVG() ASC")  # a multi-time-series alarm: the idlest first
    assert q["schema"] == {"ClusterName", "job", "Hostname"}
    [dcgm] = [d for d in obs.METRIC_DECLARATIONS if d["label_matcher"] == "^dcgm-exporter$"]
    assert any(re.search(s, q["metric"]) for s in dcgm["metric_selectors"])
    assert q["schema"] in map(frozenset, dcgm["dimensions"])  # the agent emits the per-node series
    assert "Hostname" in a["alarmDescription"] and "node" in a["alarmDescription"]
    assert query["period"] * a["evaluationPeriods"] <= 3 * 3600  # what a Metrics Insights alarm can evaluate


def test_fsx_free_capacity_alarm_threshold(stack: Stack):
    a = alarms(stack)["fsx-free-capacity-low"]
    capacity = build_plan(stack.result.stack, stack.cfg).checkpoint.fsx_capacity_gib
    assert a["dimensions"] == {"FileSystemId": stack.outputs["fsx_id"]}
    assert a["threshold"] == capacity * GIB * stack.cfg.monitoring.fsx_free_capacity_floor_percent / 100
    assert (a["metricName"], a["comparisonOperator"]) == ("FreeDataStorageCapacity", "LessThanThreshold")


def test_log_metric_filters_feed_the_alarms(stack: Stack):
    filters = {r.inputs["metricTransformation"]["name"]: r.inputs for r in stack.all(T.LOG_METRIC_FILTER)}
    assert "NCCL" in filters["NcclTimeouts"]["pattern"] and "Watchdog" in filters["NcclTimeouts"]["pattern"]
    assert "CUDA out of memory" in filters["OutOfMemory"]["pattern"]
    assert "Xid" in filters["GpuXidErrors"]["pattern"]
    cluster = stack.outputs["cluster_name"]
    assert filters["NcclTimeouts"]["logGroupName"] == f"/aws/containerinsights/{cluster}/application"
    a = alarms(stack)
    for metric, alarm in (
        ("NcclTimeouts", "nccl-timeouts"),
        ("OutOfMemory", "out-of-memory"),
        ("GpuXidErrors", "gpu-xid-errors"),
    ):
        t = filters[metric]["metricTransformation"]
        assert (a[alarm]["namespace"], a[alarm]["metricName"]) == (t["namespace"], metric)
        assert a[alarm]["threshold"] == 0 and a[alarm]["comparisonOperator"] == "GreaterThanThreshold"


def test_topic_encrypted_and_subscribed(stack: Stack):
    topic = stack.one(T.SNS_TOPIC).inputs
    assert topic["kmsMasterKeyId"] == stack.outputs["kms_key_arns"]["ops"]
    sub = stack.one(T.SNS_TOPIC_SUBSCRIPTION).inputs
    assert (sub["protocol"], sub["endpoint"], sub["topic"]) == (
        "email",
        stack.cfg.monitoring.notification_email,
        stack.outputs["sns_topic_arn"],
    )


def test_log_groups_retained_and_encrypted(stack: Stack):
    ui = stack.cfg.management.ui
    audit = (stack.outputs.get("management_ui") or {}).get("audit_log_group")  # the page's own: its own retention
    groups = [g for g in stack.all(LOG_GROUP) if g.inputs["name"] != audit]
    assert sorted(g.inputs["name"] for g in groups) == sorted(stack.outputs["log_group_names"])
    for g in groups:
        assert g.inputs["retentionInDays"] == stack.cfg.monitoring.log_retention_days
        assert g.inputs["kmsKeyId"] == stack.outputs["kms_key_arns"]["ops"]
    [audit_group] = [g for g in stack.all(LOG_GROUP) if g.inputs["name"] == audit] if ui else [None]
    if ui:
        assert audit_group.inputs["retentionInDays"] == ui.audit_retention_days
        assert audit_group.inputs["kmsKeyId"] == stack.outputs["kms_key_arns"]["ops"]


def test_observability_addon_and_dashboard(stack: Stack):
    addon = [a.inputs for a in stack.all(T.EKS_ADDON) if a.inputs["addonName"] == "amazon-cloudwatch-observability"]
    assert addon and addon[0]["serviceAccountRoleArn"].endswith(
        "role/" + stack.one(T.IAM_ROLE, "monitoring-cloudwatch-agent").outputs["name"]
    )
    body = json.loads(stack.one(T.DASHBOARD).inputs["dashboardBody"])
    metrics = [m[1] for w in body["widgets"] for m in w["properties"]["metrics"] if isinstance(m, list)]
    assert {"DCGM_FI_DEV_GPU_UTIL", "FreeDataStorageCapacity", "NcclTimeouts", "OutOfMemory"} <= set(metrics)
