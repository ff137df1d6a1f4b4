"""Trainium's alarms (issue 27): the trn2 stack has, for every accelerator alarm a GPU stack has, an alarm of
the same purpose on neuron-monitor's series or a stated reason why none can exist; it reads no DCGM field;
and every series its alarms and dashboard read is one the exporter emits with the labels they select,
as the CloudWatch agent's metric declarations turn it into a metric (followed on a recorded scrape)."""

from __future__ import annotations

import json
import re

import pytest
from aws_preview import Stack, insights_queries, insights_query, preview

from supernode.core import observability as obs
from supernode.core import resource_types as T
from supernode.core.observability import ACCELERATOR_ALARMS, NO_EQUIVALENT
from supernode.core.vendors import VENDORS

pytestmark = pytest.mark.slow  # previews of the program under the mock engine

# One scrape of neuron-monitor-prometheus.py on a Trn2 node, as that script writes it: each series with the
# labels it registers (instance labels, runtime_tag per Neuron application, then the group's own label), and
# the `job` / `Hostname` labels the scrape config adds. A counter's _created series is prometheus_client's.
RECORDED_SCRAPE = """\
neuroncore_utilization_ratio{job="neuron-monitor",Hostname="ip-10-0-1-5",instance_type="trn2u.48xlarge",neuroncore="0",runtime_tag="367"} 0.93
neuron_runtime_memory_used_bytes{job="neuron-monitor",Hostname="ip-10-0-1-5",memory_location="host",runtime_tag="367"} 9.04e+06
neuron_runtime_memory_used_bytes{job="neuron-monitor",Hostname="ip-10-0-1-5",memory_location="neuron_device",runtime_tag="367"} 2.1e+10
execution_errors_total{job="neuron-monitor",Hostname="ip-10-0-1-5",error_type="hardware",runtime_tag="367"} 1.0
execution_errors_total{job="neuron-monitor",Hostname="ip-10-0-1-5",error_type="numerical",runtime_tag="367"} 0.0
execution_errors_created{job="neuron-monitor",Hostname="ip-10-0-1-5",error_type="hardware",runtime_tag="367"} 1.708e+09
hardware_ecc_events_total{job="neuron-monitor",Hostname="ip-10-0-1-5",event_type="mem_ecc_uncorrected",neuron_device_index="7"} 0.0
hardware_ecc_events_total{job="neuron-monitor",Hostname="ip-10-0-1-5",event_type="sram_ecc_uncorrected",neuron_device_index="7"} 2.0
system_memory_used_bytes{job="neuron-monitor",Hostname="ip-10-0-1-5",instance_type="trn2u.48xlarge"} 1.6e+10
"""


RECORDED_LABELS = {"Hostname": "ip-10-0-1-5"}  # the recorded scrape's node


def parse(exposition: str) -> list[tuple[str, dict[str, str]]]:
    series = []
    for line in exposition.splitlines():
        name, labels = re.fullmatch(r"(\w+)\{(.*)\} \S+", line).groups()
        series.append((name, dict(re.findall(r'(\w+)="([^"]*)"', labels))))
    return series


def cloudwatch_metrics(series: list[tuple[str, dict[str, str]]], cluster: str) -> set[tuple[str, frozenset]]:
    """What the CloudWatch agent makes of the series: for each declaration whose job and metric selector
    match, one metric per dimension set whose labels the series all has (ClusterName added by the agent)."""
    out = set()
    for name, labels in series:
        labels = {**labels, "ClusterName": cluster}
        for d in obs.METRIC_DECLARATIONS:
            if re.search(d["label_matcher"], labels["job"]) and any(re.search(s, name) for s in d["metric_selectors"]):
                for dims in d["dimensions"]:
                    if all(k in labels for k in dims):
                        out.add((name, frozenset((k, labels[k]) for k in dims)))
    return out


@pytest.fixture(scope="module")
def trn2() -> Stack:
    return preview("trn2")


def alarms(stack: Stack) -> dict[str, dict]:
    return {
        r.inputs["name"].removeprefix(f"supernode-{stack.result.stack}-"): r.inputs for r in stack.all(T.METRIC_ALARM)
    }


def read_series(stack: Stack) -> list[tuple[str, dict]]:
    """(metric, dimensions) of every alarm metric and dashboard series in the Prometheus namespace."""
    out = []
    for a in stack.all(T.METRIC_ALARM):
        queries = [q["metric"] for q in a.inputs.get("metricQueries") or [] if q.get("metric")]
        out += [
            (m["metricName"], m["dimensions"])
            for m in [a.inputs, *queries]
            if m.get("namespace") == obs.PROMETHEUS_NAMESPACE
        ]
        # a Metrics Insights query: its WHERE values, and each GROUP BY dimension of the recorded scrape
        out += [
            (q["metric"], {**q["where"], **{k: RECORDED_LABELS[k] for k in q["group_by"]}})
            for q in insights_queries(a.inputs)
            if q["namespace"] == obs.PROMETHEUS_NAMESPACE
        ]
    body = json.loads(stack.one(T.DASHBOARD).inputs["dashboardBody"])
    for w in body["widgets"]:
        for s in w["properties"]["metrics"]:
            if isinstance(s, list) and s[0] == obs.PROMETHEUS_NAMESPACE:
                names = [x for x in s if not isinstance(x, dict)]
                out.append((names[1], dict(zip(names[2::2], names[3::2]))))
    return out


@pytest.mark.parametrize("gpu_stack", ["dev", "prod"])
def test_every_gpu_alarm_has_a_trainium_alarm_of_its_purpose_or_a_reason(gpu_stack: str, trn2: Stack):
    gpu, neuron = set(alarms(preview(gpu_stack))), set(alarms(trn2))
    # The queue alarms are named after each stack's own queues and namespaces (gpu-h100, gpu-trainium2):
    # both stacks have them, and test_queue_metrics.py holds each to its queues.
    per_queue = ("queue-wait-", "job-failure-rate-")
    assert all(any(n.startswith(p) for n in names) for p in per_queue for names in (gpu, neuron))
    gpu, neuron = {n for n in gpu if not n.startswith(per_queue)}, {n for n in neuron if not n.startswith(per_queue)}
    # The serving SLO alarms exist where a stack serves, on any vendor (trn2 has no inference section;
    # tests/components/test_serving_slo_metrics.py holds each serving stack to its model's alarms).
    serves = [n for n in gpu if n.startswith("serving-")]
    assert bool(serves) == (preview(gpu_stack).cfg.inference is not None)
    gpu -= set(serves)
    nvidia_names = {names["nvidia"] for names in ACCELERATOR_ALARMS.values()}
    # Every accelerator alarm of a GPU stack is in the table (a new one cannot be forgotten on Trainium) ...
    assert nvidia_names <= gpu
    for purpose, names in ACCELERATOR_ALARMS.items():
        if "neuron" in names:
            assert names["neuron"] in neuron, purpose
        else:
            assert NO_EQUIVALENT.get((purpose, "neuron")), f"{purpose}: no Trainium alarm and no reason why"
            assert names["nvidia"] not in neuron, purpose  # no GPU alarm left behind on DCGM's metrics
    # ... and every other alarm watches what both vendors have, under the same name.
    assert gpu - nvidia_names <= neuron
    assert neuron - (gpu - nvidia_names) == {n["neuron"] for n in ACCELERATOR_ALARMS.values() if "neuron" in n}


def test_no_trainium_alarm_or_widget_reads_dcgm(trn2: Stack):
    read = read_series(trn2)
    assert not [m for m, _ in read if m.startswith("DCGM_")]
    assert {m for m, d in read if d.get("job") == obs.NEURON_SCRAPE_JOB} == {
        obs.NEURONCORE_UTIL,
        obs.NEURON_HOST_MEMORY_USED,
        obs.NEURON_MEMORY_USED,
        obs.NEURON_ECC_EVENTS,
        obs.NEURON_EXECUTION_ERRORS,
    }
    filters = {r.inputs["metricTransformation"]["name"] for r in trn2.all(T.LOG_METRIC_FILTER)}
    assert not {"GpuXidErrors", "NodesQuarantined", "NodesReplaced"} & filters and "NcclTimeouts" in filters


def test_the_scrape_job_is_the_one_the_alarms_name(trn2: Stack):
    assert VENDORS["neuron"].scrape_job == obs.NEURON_SCRAPE_JOB
    scrape = json.dumps(
        [r.inputs for r in trn2.all(T.CONFIG_MAP) if r.inputs["metadata"]["name"] == "prometheus-config"]
    )
    assert f"job_name: {obs.NEURON_SCRAPE_JOB}" in scrape


def test_every_series_read_reaches_cloudwatch_from_a_recorded_scrape(trn2: Stack):
    cluster = trn2.outputs["cluster_name"]
    emitted = cloudwatch_metrics(parse(RECORDED_SCRAPE), cluster)
    neuron_reads = [(m, d) for m, d in read_series(trn2) if d.get("job") == obs.NEURON_SCRAPE_JOB]
    assert neuron_reads
    for metric, dims in neuron_reads:
        assert (metric, frozenset(dims.items())) in emitted, (metric, dims)
    # A series outside the declarations (prometheus_client's _created twin) never becomes a metric.
    assert not [m for m, _ in emitted if m.endswith("_created")]


def test_neuron_alarm_thresholds(trn2: Stack):
    m, found, cluster = trn2.cfg.monitoring, alarms(trn2), trn2.outputs["cluster_name"]
    util = found["neuroncore-util-low"]
    [query] = util["metricQueries"]
    q = insights_query(query["expression"])
    assert q["metric"] == obs.NEURONCORE_UTIL and q["stat"] == "AVG"
    # per node (a contributor per Hostname), not the mean over the cluster's NeuronCores (issue 41 item 4)
    assert q["group_by"] == ["Hostname"] and q["schema"] == {"ClusterName", "job", "Hostname"}
    assert q["where"] == {"ClusterName": cluster, "job": "neuron-monitor"}
    assert util["threshold"] == m.gpu_util_floor_percent / 100  # a 0-1 ratio, the floor is a percentage
    assert query["period"] * util["evaluationPeriods"] == m.gpu_util_window_minutes * 60
    hw = found["neuron-hardware-errors"]
    assert hw["dimensions"] == {"ClusterName": cluster, "job": "neuron-monitor", "error_type": "hardware"}
    assert (hw["statistic"], hw["threshold"], hw["comparisonOperator"]) == ("Sum", 0, "GreaterThanThreshold")
    ecc = found["neuron-ecc-uncorrectable"]["metricQueries"]
    assert sorted(q["metric"]["dimensions"]["event_type"] for q in ecc if q.get("metric")) == [
        "mem_ecc_uncorrected",
        "sram_ecc_uncorrected",
    ]
    absent = found["neuron-exporter-absent"]
    assert (absent["metricName"], absent["statistic"], absent["treatMissingData"]) == (
        obs.NEURON_HOST_MEMORY_USED,
        "SampleCount",
        "breaching",
    )
