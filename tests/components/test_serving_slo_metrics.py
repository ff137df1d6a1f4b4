"""Serving SLOs (issue 38, item 4), read from the previews of the real program and followed end to end:
the serving Prometheus keeps vLLM's latency histograms, request counter and queue gauges; the SLO relay
beside it reads them from its federation endpoint; the CloudWatch agent scrapes the relay's port (and
may reach it through the NetworkPolicy); its declarations give the relay's gauges the model's
dimensions; and the alarms read exactly those series against the Plan's targets."""

from __future__ import annotations

import json
import re
import urllib.parse

import pytest
import yaml
from aws_preview import preview
from test_queue_metrics import _declared, alarms, declarations, pod, relabel_keeps, scrape_jobs, targets, the

from supernode.components.k8s import serving as sv
from supernode.core import observability as obs
from supernode.core.plan import build_plan
from supernode.tools import manifests as mf

pytestmark = pytest.mark.slow  # previews of the program under the mock engine

MON = obs.SERVING_MONITORING_NAMESPACE


@pytest.fixture(scope="module", params=["dev", "prod"])
def stack(request):
    return preview(request.param)


@pytest.fixture(scope="module")
def manifests(stack) -> list[dict]:
    return mf.from_resources(stack.result.resources)


@pytest.fixture(scope="module")
def objs(manifests):
    return {(m["kind"], m["metadata"].get("namespace", ""), m["metadata"]["name"]): m for m in manifests}


def prometheus(objs) -> dict:
    return the(objs, "Deployment", "prometheus", MON)


def relay(objs) -> dict:
    [c] = [c for c in pod(prometheus(objs))["containers"] if c["name"] == obs.SERVING_SLO_SCRAPE_JOB]
    return c


def arg(container: dict, flag: str) -> str:
    return container["args"][container["args"].index(flag) + 1]


def test_the_relay_runs_beside_the_serving_prometheus_on_its_federation_endpoint(stack, objs):
    c = relay(objs)
    assert c["image"] == stack.cfg.images.trainer
    assert c["command"] == ["python", "-m", "supernode.trainer.serving_slo", "watch"]
    assert float(arg(c, "--window-s")) == stack.cfg.monitoring.serving_slo_window_minutes * 60
    source = urllib.parse.urlsplit(arg(c, "--source"))
    [web] = [p["containerPort"] for p in pod(prometheus(objs))["containers"][0]["ports"] if p["name"] == "web"]
    assert (source.scheme, source.hostname, source.port, source.path) == ("http", "127.0.0.1", web, "/federate")
    [match] = urllib.parse.parse_qs(source.query)["match[]"]
    selector = re.fullmatch(r'\{__name__=~"(.*)"\}', match).group(1)
    for series in sv.SLO_SERIES:
        assert re.fullmatch(selector, series), series
    assert not re.fullmatch(selector, "vllm:prompt_tokens_total")
    assert mf.validate([prometheus(objs)], stack.cfg.cluster.kubernetes_version) == []


def test_the_serving_prometheus_keeps_what_the_relay_and_the_hpa_read_and_no_more(objs):
    [volume] = [v for v in pod(prometheus(objs))["volumes"] if v["name"] == "config"]
    data = the(objs, "ConfigMap", volume["configMap"]["name"], MON)["data"]
    config = yaml.safe_load(data[sv.PROMETHEUS_CONFIG])
    [job] = config["scrape_configs"]
    [keep] = job["metric_relabel_configs"]
    for series in (*sv.SLO_SERIES, *sv.BACKEND.in_flight_series):
        assert re.fullmatch(keep["regex"], series), series
    for other in ("vllm:prompt_tokens_total", f"{obs.VLLM_TTFT}_sum", "vllm:kv_cache_usage_perc"):
        assert not re.fullmatch(keep["regex"], other), other


def test_the_agent_scrapes_the_relays_port_and_may_reach_it(objs):
    scrape = scrape_jobs(objs)[obs.SERVING_SLO_SCRAPE_JOB]
    assert scrape["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": [MON]}}]
    found = targets_of_every_container(prometheus(objs))
    kept = [name for name, meta in found.items() if relabel_keeps(scrape["relabel_configs"], meta)]
    assert kept == ["metrics"]  # the relay's, not Prometheus' own web port
    bindings = {m["metadata"]["namespace"] for (k, _, n), m in objs.items() if k == "RoleBinding" and "cwagent" in n}
    assert MON in bindings
    [policy] = [m for (k, ns, _), m in objs.items() if k == "NetworkPolicy" and ns == MON and "prometheus" in str(m)]
    rules = policy["spec"]["ingress"]
    to_relay = [r for r in rules if {"protocol": "TCP", "port": sv.SLO_RELAY_PORT} in r["ports"]]
    assert to_relay == [
        {
            "from": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": obs.METRICS_SCRAPER_NAMESPACE}}}
            ],
            "ports": [{"protocol": "TCP", "port": sv.SLO_RELAY_PORT}],
        }
    ]


def targets_of_every_container(workload: dict) -> dict[str, dict[str, str]]:
    """targets() for a pod of several containers: one target per port of any of them."""
    one = {**workload, "spec": {**workload["spec"], "template": {**workload["spec"]["template"]}}}
    out = {}
    for c in pod(workload)["containers"]:
        one["spec"]["template"] = {**workload["spec"]["template"], "spec": {**pod(workload), "containers": [c]}}
        out.update(targets(one, workload["metadata"]["namespace"]))
    return out


def test_declarations_give_every_relay_gauge_the_models_dimensions(objs):
    decls = declarations(objs)
    for metric in obs.SERVING_SLO_METRICS:
        assert _declared(decls, obs.SERVING_SLO_SCRAPE_JOB, metric) == [frozenset(obs.SERVING_DIMENSIONS)], metric
    assert not _declared(decls, obs.SERVING_SLO_SCRAPE_JOB, f"{obs.VLLM_TTFT}_bucket")  # dropped anyway


def test_slo_alarms_take_the_plans_targets_and_read_declared_series(stack, objs):
    ip = build_plan(stack.result.stack, stack.cfg).inference
    model = sv.serving_app(stack.result.stack)
    found = alarms(stack)
    serving = {n: a for n, a in found.items() if n.startswith("serving-")}
    expected = {"ttft": ip.ttft_target_ms, "itl": ip.itl_target_ms}
    wanted = {obs.serving_slo_alarm(p, model) for p, t in expected.items() if t is not None}
    assert set(serving) == wanted | {obs.serving_slo_alarm("errors", model)}
    if stack.result.stack == "prod":  # prod sets both targets: 2000 ms and 50 ms
        assert len(serving) == 3
    dims = obs.serving_dimensions(stack.outputs["cluster_name"], model)
    decls = declarations(objs)
    metrics = {"ttft": obs.SERVING_TTFT_P99, "itl": obs.SERVING_ITL_P99, "errors": obs.SERVING_ERROR_RATIO}
    thresholds = {p: t / 1e3 for p, t in expected.items() if t is not None}
    thresholds["errors"] = stack.cfg.monitoring.serving_error_rate_max
    for purpose, threshold in thresholds.items():
        a = serving[obs.serving_slo_alarm(purpose, model)]
        assert (a["metricName"], a["statistic"], a["namespace"]) == (
            metrics[purpose],
            "Maximum",
            obs.PROMETHEUS_NAMESPACE,
        )
        assert a["dimensions"] == dims and frozenset(dims) in _declared(decls, dims["job"], a["metricName"])
        assert a["threshold"] == pytest.approx(threshold) and a["comparisonOperator"] == "GreaterThanThreshold"
        assert a["evaluationPeriods"] == a["datapointsToAlarm"] >= 2
    # the alarms' model_name is the name the server serves under (vLLM's model_name label)
    server = the(objs, ip.workload_kind, model, stack.cfg.inference.namespace)
    assert f'"--served-model-name", "{model}"' in json.dumps(server)


def test_a_changed_target_moves_its_alarm_and_an_unset_one_has_none():
    def change(data: dict) -> None:
        data["inference"]["ttftTargetMs"] = 1500
        data["inference"].pop("itlTargetMs")
        data["monitoring"]["servingErrorRateMax"] = 0.05

    variant = preview("prod", "slo-targets", change)
    model = sv.serving_app("prod")
    found = {n: a for n, a in alarms(variant).items() if n.startswith("serving-")}
    assert set(found) == {obs.serving_slo_alarm("ttft", model), obs.serving_slo_alarm("errors", model)}
    assert found[obs.serving_slo_alarm("ttft", model)]["threshold"] == pytest.approx(1.5)
    assert found[obs.serving_slo_alarm("errors", model)]["threshold"] == pytest.approx(0.05)


def test_the_dashboard_shows_the_models_slo_gauges_with_the_alarms_targets(stack, objs):
    ip = build_plan(stack.result.stack, stack.cfg).inference
    model = sv.serving_app(stack.result.stack)
    dims = obs.serving_dimensions(stack.outputs["cluster_name"], model)
    body = json.loads(stack.one("aws:cloudwatch/dashboard:Dashboard").inputs["dashboardBody"])
    serving = [w["properties"] for w in body["widgets"] if w["properties"]["title"].startswith(f"{model}: ")]
    series = [m for w in serving for m in w["metrics"]]
    decls = declarations(objs)
    # every relay gauge is shown, and each series is one the agent emits with the model's dimensions
    assert {m[1] for m in series} == set(obs.SERVING_SLO_METRICS)
    for m in series:
        assert m[0] == obs.PROMETHEUS_NAMESPACE and dict(zip(m[2:-1:2], m[3:-1:2])) == dims, m
        assert frozenset(dims) in _declared(decls, dims["job"], m[1])
    lines = {w["metrics"][0][1]: w.get("annotations", {}).get("horizontal", [{}])[0].get("value") for w in serving}
    assert lines[obs.SERVING_TTFT_P99] == (ip.ttft_target_ms and pytest.approx(ip.ttft_target_ms / 1e3))
    assert lines[obs.SERVING_ITL_P99] == (ip.itl_target_ms and pytest.approx(ip.itl_target_ms / 1e3))
    assert lines[obs.SERVING_ERROR_RATIO] == pytest.approx(stack.cfg.monitoring.serving_error_rate_max)
