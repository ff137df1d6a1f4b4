"""Training health in the monitoring (issue 18, item 2): alarms on the trainer's progress,
throughput, non-finite loss, checkpoint age and restarts, with thresholds from the config and the
plan; dashboards (CloudWatch and Grafana) that read only metrics the trainer really exports."""

from __future__ import annotations

import json
import re

import pytest
from aws_preview import ROOT, Stack, preview

from supernode.components.aws.monitoring import LogPattern
from supernode.core import resource_types as T
from supernode.core.config import load_stack
from supernode.core.observability import (
    METRIC_DECLARATIONS,
    PROMETHEUS_NAMESPACE,
    TRAINER_DIMENSIONS,
    TRAINER_METRICS,
    TRAINER_SCRAPE_JOB,
)
from supernode.core.plan import build_local_plan, build_plan
from supernode.trainer.metrics import Metrics
from supernode.trainer.node import fabric

GRAFANA = ROOT / "components" / "dashboards" / "training.json"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """The metric names the trainer's Prometheus registry exports (read from the trainer itself)."""
    plan = build_local_plan("dev", load_stack("dev", ROOT))
    m = Metrics(tmp_path_factory.mktemp("metrics"), plan, world_size=1, device_type="cpu", rank=0)
    names = {family.name for family in m.registry.collect()}
    m.close()
    assert "supernode_train_loss" in names  # the registry was read, not an empty set
    return names


def test_the_trainer_exports_exactly_the_contracts_gauges(exported):
    """The trainer registers the observability contract's gauges, so none it exports goes unscraped."""
    assert exported == {m.name for m in TRAINER_METRICS}


def test_every_trainer_gauge_becomes_a_metric_with_its_label_as_a_dimension():
    for m in TRAINER_METRICS:
        [declared] = [d for d in METRIC_DECLARATIONS if re.search(d["metric_selectors"][0], m.name)]
        assert declared["label_matcher"] == f"^{TRAINER_SCRAPE_JOB}$"
        assert declared["dimensions"] == [[*TRAINER_DIMENSIONS, *([m.label] if m.label else [])]]


def alarms(stack: Stack) -> dict[str, dict]:
    return {
        r.inputs["name"].removeprefix(f"supernode-{stack.result.stack}-"): r.inputs for r in stack.all(T.METRIC_ALARM)
    }


def queried(alarm: dict) -> dict[str, dict]:
    return {q["id"]: q for q in alarm.get("metricQueries") or []}


def test_step_stall_alarm_watches_the_step_gauge_over_the_configured_window(stack: Stack, exported):
    a = alarms(stack)["training-step-stalled"]
    q = queried(a)
    window = stack.cfg.monitoring.step_stall_minutes * 60
    for qid, stat in (("last", "Maximum"), ("first", "Minimum")):
        metric = q[qid]["metric"]
        assert (metric["namespace"], metric["metricName"], metric["stat"]) == (
            PROMETHEUS_NAMESPACE,
            "supernode_train_step",
            stat,
        )
        assert metric["period"] == window and metric["metricName"] in exported
        assert metric["dimensions"]["Namespace"] == stack.cfg.workload.namespace
    assert q["advanced"]["expression"] == "last - first" and q["advanced"]["returnData"] is True
    assert (a["threshold"], a["comparisonOperator"]) == (0, "LessThanOrEqualToThreshold")


def test_throughput_floor_is_the_configured_fraction_of_the_plans_estimate(stack: Stack, exported):
    plan = build_plan(stack.result.stack, stack.cfg)
    estimate = plan.training.global_batch * plan.model.seq_len / plan.step.step_s
    a = alarms(stack)["training-throughput-low"]
    assert a["metricName"] == "supernode_train_tokens_per_s" and a["metricName"] in exported
    assert a["threshold"] == pytest.approx(stack.cfg.monitoring.throughput_floor_fraction * estimate, abs=0.1)
    assert a["comparisonOperator"] == "LessThanThreshold"
    assert a["evaluationPeriods"] * a["period"] == stack.cfg.monitoring.step_stall_minutes * 60


def test_plan_drift_alarms_on_the_measured_over_planned_step_either_way(stack: Stack, exported):
    """Issue 29 item 4: the trainer exports measured / planned step time; the alarm fires when it is
    off 1 by more than monitoring.planDriftFraction for the stall window."""
    a = alarms(stack)["training-plan-drift"]
    q = queried(a)
    assert q["ratio"]["metric"]["metricName"] == "supernode_train_step_time_over_plan" in exported
    assert q["ratio"]["metric"]["namespace"] == PROMETHEUS_NAMESPACE
    assert q["ratio"]["metric"]["dimensions"]["Namespace"] == stack.cfg.workload.namespace
    assert q["drift"]["expression"] == "ABS(ratio - 1)" and q["drift"]["returnData"] is True
    assert (a["threshold"], a["comparisonOperator"]) == (
        stack.cfg.monitoring.plan_drift_fraction,
        "GreaterThanThreshold",
    )
    assert a["evaluationPeriods"] * q["ratio"]["metric"]["period"] == stack.cfg.monitoring.step_stall_minutes * 60


def test_a_changed_config_moves_the_thresholds():
    def change(data: dict) -> None:
        data["monitoring"].update(stepStallMinutes=40, throughputFloorFraction=0.25, restartAlarmCount=5)

    base, changed = preview("dev"), preview("dev", "health-thresholds", change)
    a, b = alarms(base), alarms(changed)
    assert queried(b["training-step-stalled"])["last"]["metric"]["period"] == 40 * 60
    assert b["training-throughput-low"]["threshold"] == pytest.approx(
        a["training-throughput-low"]["threshold"] / 2, rel=1e-3
    )
    assert b["training-restarts"]["threshold"] == 5 and b["training-restarts"]["period"] == 3600


def test_log_alarms_match_what_the_checks_print(stack: Stack):
    """The JSON filters read the field the fabric check prints (the trainer's lines are matched against a
    real run's output in tests/trainer/test_failures.py). A renamed field breaks this test, not the pager."""
    found = fabric.compare([{"pair": ["a", "b"], "gb_s": 1.0, "latency_us": 1.0}], 0.2)
    assert "fabric_regressed_node_count" in found and "$.fabric_regressed_node_count" in LogPattern.FABRIC_REGRESSED
    filters = {r.inputs["metricTransformation"]["name"]: r.inputs for r in stack.all(T.LOG_METRIC_FILTER)}
    assert filters["FabricRegressedNodes"]["metricTransformation"]["value"] == "$.fabric_regressed_node_count"
    a = alarms(stack)
    for metric, alarm in (
        ("NonFiniteSteps", "training-loss-not-finite"),
        ("TrainerStarts", "training-restarts"),
        ("FabricRegressedNodes", "fabric-regressed"),
        ("InventoryDrift", "inventory-drift"),
        ("RestoreDrillFailures", "restore-drill-failed"),
    ):
        assert a[alarm]["metricName"] == metric and metric in filters
    assert a["training-restarts"]["threshold"] == stack.cfg.monitoring.restart_alarm_count


def test_checkpoint_stale_is_two_intervals_at_the_planned_step_time(stack: Stack):
    plan = build_plan(stack.result.stack, stack.cfg)
    q = queried(alarms(stack)["checkpoint-stale"])
    window = q["saved"]["metric"]["period"]
    assert window % 60 == 0 and 2 * plan.training.checkpoint_interval * plan.step.step_s <= window
    assert window < 2 * plan.training.checkpoint_interval * plan.step.step_s + 60
    assert q["saved"]["metric"]["metricName"] == "CheckpointsSaved" and q["last"]["metric"]["period"] == window
    assert "progress > 0" in q["stale"]["expression"] and q["stale"]["returnData"] is True


def test_cloudwatch_dashboard_reads_only_exported_trainer_metrics(stack: Stack, exported):
    body = json.loads(stack.one(T.DASHBOARD).inputs["dashboardBody"])
    names = set()
    for w in body["widgets"]:
        for m in w["properties"]["metrics"]:
            # the trainer's series (the DCGM exporter's share the namespace: test_operations checks those)
            if isinstance(m, list) and m[0] == PROMETHEUS_NAMESPACE and TRAINER_SCRAPE_JOB in m:
                names.add(m[1])
            elif isinstance(m, dict):
                names |= set(re.findall(r'MetricName=\\?"(\w+)\\?"', m["expression"]))
    assert {
        "supernode_train_loss",
        "supernode_train_tokens_per_s",
        "supernode_train_mfu",
        "supernode_train_phase_seconds",
        "supernode_train_expert_load_max_over_mean",
        "supernode_train_last_checkpoint_timestamp_seconds",
    } <= names
    assert names <= exported


def test_checkpoint_age_panels_read_the_commit_time_gauge(stack: Stack, exported):
    """Age = now - the trainer's commit-time gauge: CloudWatch's EPOCH of each datapoint, Grafana's time()."""
    body = json.loads(stack.one(T.DASHBOARD).inputs["dashboardBody"])
    age = next(w["properties"] for w in body["widgets"] if w["properties"]["title"].startswith("Checkpoint age"))
    ts, expr = age["metrics"]
    assert ts[1] == "supernode_train_last_checkpoint_timestamp_seconds" in exported and ts[-1]["id"] == "ts"
    assert expr["expression"] == "EPOCH(ts) - ts"
    window = queried(alarms(stack)["checkpoint-stale"])["saved"]["metric"]["period"]
    assert age["annotations"]["horizontal"][0]["value"] == window  # the line where the alarm fires
    doc = json.loads(GRAFANA.read_text(encoding="utf-8"))
    panel = next(p for p in doc["panels"] if p["title"] == "Checkpoint age")
    assert panel["targets"][0]["expr"].startswith("time() - supernode_train_last_checkpoint_timestamp_seconds{")
    assert panel["fieldConfig"]["defaults"]["unit"] == "s"


PROMQL_WORDS = {
    "rate",
    "irate",
    "sum",
    "avg",
    "max",
    "min",
    "by",
    "without",
    "on",
    "time",
    "increase",
    "delta",
    "deriv",
    "clamp_min",
    "clamp_max",
    "histogram_quantile",
}


def grafana_metrics(doc: dict) -> dict[str, set[str]]:
    """Panel title -> the metric names its PromQL targets read (label names, functions and the
    `[5m]` ranges stripped)."""
    out = {}
    for p in doc["panels"]:
        names = set()
        for t in p["targets"]:
            expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", t["expr"])
            names |= {
                w
                for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
                if w not in PROMQL_WORDS and not re.fullmatch(r"[0-9e]+", w)
            }
        out[p["title"]] = names
    return out


def test_grafana_dashboard_panels_read_metrics_the_trainer_exports(exported):
    doc = json.loads(GRAFANA.read_text(encoding="utf-8"))
    panels = grafana_metrics(doc)
    assert len(panels) == len(doc["panels"]) >= 6
    for title, names in panels.items():
        assert names, f"panel {title!r} reads no metric"
        assert names <= exported, f"panel {title!r} reads {sorted(names - exported)}, which the trainer does not export"
    shown = set().union(*panels.values())
    assert {
        "supernode_train_loss",
        "supernode_train_tokens_per_s",
        "supernode_train_mfu",
        "supernode_train_expert_load_max_over_mean",
        "supernode_train_phase_seconds",
    } <= shown


def test_grafana_check_catches_a_misspelt_metric(exported):
    doc = {"panels": [{"title": "t", "targets": [{"expr": 'rate(supernode_train_stepz{namespace="x"}[5m])'}]}]}
    assert grafana_metrics(doc)["t"] == {"supernode_train_stepz"} and not grafana_metrics(doc)["t"] <= exported


def test_nvidia_device_plugin_fails_on_init_errors():
    """Issue 18, item 4: a node whose GPUs are not recognised must not look healthy."""
    from supernode.components.k8s.common import load_addon

    container = load_addon("nvidia-device-plugin.yaml")["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "FAIL_ON_INIT_ERROR", "value": "true"} in container["env"]
