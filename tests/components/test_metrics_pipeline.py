"""The two metrics pipelines, read from the previews of the real program and followed end to end:
the CloudWatch agent's Prometheus scrape (trainer and DCGM series to CloudWatch, which the training
alarms read) and, with serving, Prometheus -> prometheus-adapter -> the serving HPA's custom metric.
Each test checks that what one object names is what the next one provides."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from aws_preview import Stack, policy, preview, statements

from supernode.components.k8s import serving
from supernode.components.k8s.addons import CONFIG_HASH, addon_images
from supernode.components.k8s.operations import AGENT_CONFIGMAP, SCRAPE_CONFIGMAP, scraped_namespaces
from supernode.core import observability as obs
from supernode.core import resource_types as T
from supernode.core.observability import METRICS_SCRAPER_NAMESPACE
from supernode.core.serving import BACKEND
from supernode.tools import manifests as mf

pytestmark = pytest.mark.slow  # previews of the program under the mock engine

Objects = dict[tuple[str, str, str], dict]


def objects(stack: Stack) -> Objects:
    """(kind, namespace, name) -> the manifest `preview --manifests` writes."""
    return {
        (m["kind"], m["metadata"].get("namespace", ""), m["metadata"]["name"]): m
        for m in mf.from_resources(stack.result.resources)
    }


@pytest.fixture(scope="module")
def dev() -> Stack:
    return preview("dev")


@pytest.fixture(scope="module")
def objs(dev) -> Objects:
    return objects(dev)


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def the(objs: Objects, kind: str, name: str, namespace: str = "") -> dict:
    found = [m for (k, ns, n), m in objs.items() if k == kind and n == name and (not namespace or ns == namespace)]
    assert len(found) == 1, (kind, namespace, name, len(found))
    return found[0]


def mounted_configmap(pod: dict, name: str) -> str:
    """The mount path of the ConfigMap volume `name` refers to."""
    [volume] = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == name]
    [path] = [
        m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", []) if m["name"] == volume["name"]
    ]
    return path


def flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


# -- the CloudWatch agent's Prometheus scrape (issue 18) ------------------------------------------------


def test_agent_deployment_mounts_both_configmaps_by_their_real_names(objs):
    agent = the(objs, "Deployment", "cwagent-prometheus", METRICS_SCRAPER_NAMESPACE)
    pod = pod_spec(agent)
    scrape = the(objs, "ConfigMap", SCRAPE_CONFIGMAP, METRICS_SCRAPER_NAMESPACE)
    config = the(objs, "ConfigMap", AGENT_CONFIGMAP, METRICS_SCRAPER_NAMESPACE)
    # the paths the agent reads: its JSON configuration directory, and the Prometheus file it names
    assert mounted_configmap(pod, AGENT_CONFIGMAP) == "/etc/cwagentconfig" and list(config["data"]) == [
        "cwagentconfig.json"
    ]
    prometheus = json.loads(config["data"]["cwagentconfig.json"])["logs"]["metrics_collected"]["prometheus"]
    [key] = scrape["data"]
    assert prometheus["prometheus_config_path"] == f"{mounted_configmap(pod, SCRAPE_CONFIGMAP)}/{key}"
    assert agent["spec"]["replicas"] == 1  # a second replica would scrape every target twice
    # a changed configuration rolls the pod (the agent reads it only at start)
    assert len(agent["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]) == 64
    [c] = pod["containers"]
    assert (
        c["securityContext"]["capabilities"]["drop"] == ["ALL"] and not c["securityContext"]["allowPrivilegeEscalation"]
    )


def test_agent_role_writes_the_prometheus_log_group_and_nothing_else(dev, objs):
    agent = the(objs, "Deployment", "cwagent-prometheus", METRICS_SCRAPER_NAMESPACE)
    sa = the(objs, "ServiceAccount", pod_spec(agent)["serviceAccountName"], METRICS_SCRAPER_NAMESPACE)
    [role] = [r for r in dev.all(T.IAM_ROLE) if r.name == "metrics-agent-role"]
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == role.outputs["arn"]
    [trust] = statements(policy(role, "assumeRolePolicy"))
    [sub] = [v for k, v in trust["Condition"]["StringEquals"].items() if k.endswith(":sub")]
    assert sub == f"system:serviceaccount:{METRICS_SCRAPER_NAMESPACE}:{sa['metadata']['name']}"

    [inline] = [p for p in dev.all(T.IAM_ROLE_POLICY) if p.parent == role.parent]
    [allow] = statements(policy(inline))
    # Embedded-metric-format events into the group the agent's configuration names; CloudWatch Logs
    # extracts the metrics, so no PutMetricData, no log group creation, no other group.
    config = json.loads(
        the(objs, "ConfigMap", AGENT_CONFIGMAP, METRICS_SCRAPER_NAMESPACE)["data"]["cwagentconfig.json"]
    )
    group_name = config["logs"]["metrics_collected"]["prometheus"]["log_group_name"]
    [group] = [g for g in dev.all(T.LOG_GROUP) if g.inputs["name"] == group_name]
    assert allow["Effect"] == "Allow" and sorted(allow["Action"]) == ["logs:CreateLogStream", "logs:PutLogEvents"]
    assert allow["Resource"] == [group.outputs["arn"], group.outputs["arn"] + ":log-stream:*"]
    assert "*" not in json.dumps(allow["Action"]) and "cloudwatch:PutMetricData" not in allow["Action"]


def test_agent_reads_pods_only_in_the_namespaces_it_scrapes(dev, objs):
    scrape = yaml.safe_load(
        the(objs, "ConfigMap", SCRAPE_CONFIGMAP, METRICS_SCRAPER_NAMESPACE)["data"]["prometheus.yaml"]
    )
    namespaces = scraped_namespaces(scrape)
    # the trainer's, DCGM's and the training operator's, Kueue's, and (dev serves) the serving SLO relay's
    assert namespaces == sorted(
        {dev.cfg.workload.namespace, "supernode-system", "kueue-system", serving.MONITORING_NAMESPACE}
    )
    role = the(objs, "ClusterRole", "cwagent-prometheus-pods")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    bindings = [m for (k, _, n), m in objs.items() if m.get("roleRef", {}).get("name") == "cwagent-prometheus-pods"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == namespaces
    assert {b["kind"] for b in bindings} == {"RoleBinding"}  # never cluster-wide
    for b in bindings:
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": "cwagent-prometheus", "namespace": METRICS_SCRAPER_NAMESPACE}
        ]


# -- the serving HPA's metric (issue 17) --------------------------------------------------------------


def test_adapter_rules_are_adapter_rule_and_name_the_hpa_metric(objs):
    adapter = the(objs, "Deployment", "prometheus-adapter", serving.MONITORING_NAMESPACE)
    pod = pod_spec(adapter)
    [c] = pod["containers"]
    config = flag(c["args"], "--config")
    cm_name = next(v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v)
    cm = the(objs, "ConfigMap", cm_name, serving.MONITORING_NAMESPACE)
    assert config == f"{mounted_configmap(pod, cm_name)}/{serving.ADAPTER_CONFIG}"
    rules = yaml.safe_load(cm["data"][serving.ADAPTER_CONFIG])
    assert rules == {"rules": [serving.ADAPTER_RULE]}
    [hpa] = [m for (k, _, _), m in objs.items() if k == "HorizontalPodAutoscaler"]
    [metric] = hpa["spec"]["metrics"]
    assert rules["rules"][0]["name"]["as"] == metric["pods"]["metric"]["name"] == BACKEND.in_flight_metric
    # the adapter asks the serving Prometheus, through its Service
    svc = the(objs, "Service", "prometheus", serving.MONITORING_NAMESPACE)
    assert (
        flag(c["args"], "--prometheus-url")
        == f"http://{svc['metadata']['name']}.{serving.MONITORING_NAMESPACE}.svc:{svc['spec']['ports'][0]['port']}/"
    )


def test_apiservice_points_at_the_adapter_service(objs):
    api = the(objs, "APIService", "v1beta1.custom.metrics.k8s.io")
    assert (api["spec"]["group"], api["spec"]["version"]) == ("custom.metrics.k8s.io", "v1beta1")
    ref = api["spec"]["service"]
    svc = the(objs, "Service", ref["name"], ref["namespace"])
    [port] = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]]
    adapter = the(objs, "Deployment", "prometheus-adapter", serving.MONITORING_NAMESPACE)
    labels = adapter["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    [c] = pod_spec(adapter)["containers"]
    assert port["targetPort"] in {p["name"] for p in c["ports"]}
    assert flag(c["args"], "--secure-port") == str(
        next(p["containerPort"] for p in c["ports"] if p["name"] == port["targetPort"])
    )
    # delegated authentication and authorisation, as the aggregation layer requires
    sa = pod_spec(adapter)["serviceAccountName"]
    bound = {
        (m["kind"], m["roleRef"]["name"])
        for m in objs.values()
        if m["kind"] in ("ClusterRoleBinding", "RoleBinding")
        and any(s["name"] == sa and s.get("namespace") == serving.MONITORING_NAMESPACE for s in m["subjects"])
    }
    assert {
        ("ClusterRoleBinding", "system:auth-delegator"),
        ("RoleBinding", "extension-apiserver-authentication-reader"),
    } <= bound


def _relabel_keeps(rules: list[dict], meta: dict[str, str]) -> bool:
    """Prometheus' `keep` relabelling on a target's meta labels (anchored regular expressions)."""
    for r in rules:
        if r.get("action") == "keep":
            value = ";".join(meta.get(s, "") for s in r["source_labels"])
            if not re.fullmatch(r["regex"], value):
                return False
    return True


def _target(pod: dict, namespace: str, port: int) -> dict[str, str]:
    labels = {
        f"__meta_kubernetes_pod_label_{re.sub(r'[^A-Za-z0-9_]', '_', k)}": v
        for k, v in pod["metadata"]["labels"].items()
    }
    return {
        **labels,
        "__meta_kubernetes_namespace": namespace,
        "__meta_kubernetes_pod_container_port_number": str(port),
    }


def test_prometheus_scrapes_the_serving_pods_on_vllms_port_and_keeps_what_the_rule_reads(dev, objs):
    ns = dev.cfg.inference.namespace
    prometheus = the(objs, "Deployment", "prometheus", serving.MONITORING_NAMESPACE)
    pod = pod_spec(prometheus)
    [c] = [c for c in pod["containers"] if c["name"] == "prometheus"]  # beside it: the SLO relay
    cm_name = next(v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v)
    assert flag(c["args"], "--config.file") == f"{mounted_configmap(pod, cm_name)}/{serving.PROMETHEUS_CONFIG}"
    [job] = yaml.safe_load(
        the(objs, "ConfigMap", cm_name, serving.MONITORING_NAMESPACE)["data"][serving.PROMETHEUS_CONFIG]
    )["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": [ns]}}]

    server = next(m for (k, n, _), m in objs.items() if k == "Deployment" and n == ns)
    [vllm] = pod_spec(server)["containers"]
    [port] = [p["containerPort"] for p in vllm["ports"]]
    assert port == serving.PORT and vllm["args"][vllm["args"].index("--port") + 1] == str(port)
    rules = job["relabel_configs"]
    assert _relabel_keeps(rules, _target(server["spec"]["template"], ns, port))
    assert not _relabel_keeps(rules, _target(server["spec"]["template"], ns, port + 1))  # the server's port only
    assert not _relabel_keeps(rules, _target(prometheus["spec"]["template"], ns, port))  # the serving pods only
    # the series the rule discovers and reads survive the scrape, labelled as its overrides expect
    [keep] = job["metric_relabel_configs"]
    series = re.findall(r"(vllm:\w+)\{", serving.ADAPTER_RULE["metricsQuery"])  # the series the rule reads
    assert series == list(BACKEND.in_flight_series) == ["vllm:num_requests_running", "vllm:num_requests_waiting"]
    assert all(re.fullmatch(keep["regex"], s) for s in series) and not re.fullmatch(
        keep["regex"], "vllm:e2e_request_latency_seconds_bucket"
    )
    assert serving.ADAPTER_RULE["seriesQuery"].split("{")[0] in series
    assert {r["target_label"] for r in rules if "target_label" in r} >= set(
        serving.ADAPTER_RULE["resources"]["overrides"]
    )
    # service discovery may read pods in the serving namespace only
    [binding] = [
        m
        for (k, n, _), m in objs.items()
        if k == "RoleBinding" and m["subjects"][0]["name"] == pod["serviceAccountName"]
    ]
    assert binding["metadata"]["namespace"] == ns


def test_serving_network_policy_admits_this_prometheus_to_the_metrics_port(dev, objs):
    ns = dev.cfg.inference.namespace
    [policy_] = [m for (k, n, _), m in objs.items() if k == "NetworkPolicy" and n == ns]
    admitted = [
        r for r in policy_["spec"]["ingress"] if {"protocol": "TCP", "port": serving.PORT} in r.get("ports", [])
    ]
    namespaces = {
        v
        for r in admitted
        for src in r["from"]
        for e in src.get("namespaceSelector", {}).get("matchExpressions", [])
        for v in e["values"]
    }
    assert serving.MONITORING_NAMESPACE in namespaces
    # and only the adapter may query Prometheus
    prom = the(objs, "NetworkPolicy", "prometheus", serving.MONITORING_NAMESPACE)
    adapter = the(objs, "Deployment", "prometheus-adapter", serving.MONITORING_NAMESPACE)
    rule, relay = prom["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": adapter["spec"]["selector"]["matchLabels"]}}]
    # the other rule: the CloudWatch agent to the SLO relay's port, not Prometheus' (test_serving_slo_metrics.py)
    assert relay["ports"] == [{"protocol": "TCP", "port": serving.SLO_RELAY_PORT}] != rule["ports"]


def test_no_prometheus_or_adapter_without_inference():
    stack = preview("dev", "no-inference", lambda d: d.pop("inference"))
    objs = objects(stack)
    assert not [
        key
        for key in objs
        if (key[0] == "APIService" and key[2] != "v1beta1.visibility.kueue.x-k8s.io")  # Kueue's is not serving's
        or key[1] == serving.MONITORING_NAMESPACE
        or key[2] in ("prometheus", "prometheus-adapter", serving.MONITORING_NAMESPACE)
    ]
    assert the(objs, "Deployment", "cwagent-prometheus", METRICS_SCRAPER_NAMESPACE)  # training health still flows


@pytest.mark.parametrize("name", ["dev", "prod"])
def test_every_metrics_object_validates_and_prod_pins_the_images_by_digest(name):
    def pinned(data: dict) -> None:  # as `make addon-digests` would
        data["images"]["addons"] = {n: f"{image}@sha256:{'c' * 64}" for n, image in addon_images().items()}

    stack = preview(name, "pinned add-ons", pinned)
    manifests = mf.from_resources(stack.result.resources)
    assert mf.validate(manifests, stack.cfg.cluster.kubernetes_version) == []
    objs = objects(stack)
    images = {
        c["name"]: c["image"]
        for key in [
            ("Deployment", METRICS_SCRAPER_NAMESPACE, "cwagent-prometheus"),
            ("Deployment", serving.MONITORING_NAMESPACE, "prometheus"),
            ("Deployment", serving.MONITORING_NAMESPACE, "prometheus-adapter"),
        ]
        for c in pod_spec(objs[key])["containers"]
    }
    assert images == {
        **{n: stack.cfg.images.addons[n] for n in ("cloudwatch-agent", "prometheus", "prometheus-adapter")},
        obs.SERVING_SLO_SCRAPE_JOB: stack.cfg.images.trainer,  # the SLO relay: the trainer image, pinned as it is
    }
