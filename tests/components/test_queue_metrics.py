"""Queue and failure metrics (issue 36, item 5), read from the previews of the real program and followed
end to end: Kueue's metrics endpoint and visibility API exposed (components/addons/kueue-observability.yaml),
the CloudWatch agent's scrape of Kueue, the training operator and the queue-wait relay, the embedded-metric
declarations that turn their series into CloudWatch metrics with the queue's and namespace's dimensions,
and the alarms and dashboard that read exactly those."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml
from aws_preview import Stack, preview

from supernode.components.k8s import queue_metrics as qm
from supernode.components.k8s import queues as q
from supernode.components.k8s.operations import AGENT_CONFIGMAP, SCRAPE_CONFIGMAP
from supernode.core import observability as obs
from supernode.core import resource_types as T
from supernode.core import teams as team_names
from supernode.tools import manifests as mf

pytestmark = pytest.mark.slow  # previews of the program under the mock engine

Objects = dict[tuple[str, str, str], dict]
AGENT_NS = obs.METRICS_SCRAPER_NAMESPACE


@pytest.fixture(scope="module", params=["dev", "prod"])
def stack(request) -> Stack:
    return preview(request.param)


@pytest.fixture(scope="module")
def manifests(stack) -> list[dict]:
    return mf.from_resources(stack.result.resources)


@pytest.fixture(scope="module")
def objs(manifests) -> Objects:
    return {(m["kind"], m["metadata"].get("namespace", ""), m["metadata"]["name"]): m for m in manifests}


def the(objs: Objects, kind: str, name: str, namespace: str = "") -> dict:
    found = [m for (k, ns, n), m in objs.items() if k == kind and n == name and (not namespace or ns == namespace)]
    assert len(found) == 1, (kind, namespace, name, len(found))
    return found[0]


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def controller(objs: Objects) -> dict:
    return the(objs, "Deployment", "kueue-controller-manager", q.CONTROLLER_NAMESPACE)


def ports(workload: dict) -> dict[str, int]:
    [c] = pod(workload)["containers"]
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def kueue_config(objs: Objects) -> dict:
    return yaml.safe_load(the(objs, "ConfigMap", "kueue-manager-config", q.CONTROLLER_NAMESPACE)["data"][q.CONFIG_KEY])


def scrape_jobs(objs: Objects) -> dict[str, dict]:
    scrape = yaml.safe_load(the(objs, "ConfigMap", SCRAPE_CONFIGMAP, AGENT_NS)["data"]["prometheus.yaml"])
    return {j["job_name"]: j for j in scrape["scrape_configs"]}


def declarations(objs: Objects) -> list[dict]:
    config = json.loads(the(objs, "ConfigMap", AGENT_CONFIGMAP, AGENT_NS)["data"]["cwagentconfig.json"])
    return config["logs"]["metrics_collected"]["prometheus"]["emf_processor"]["metric_declaration"]


def alarms(stack: Stack) -> dict[str, dict]:
    return {
        r.inputs["name"].removeprefix(f"supernode-{stack.result.stack}-"): r.inputs for r in stack.all(T.METRIC_ALARM)
    }


def cluster_queues(stack: Stack) -> set[str]:
    return {r.inputs["metadata"]["name"] for r in stack.all(T.CLUSTER_QUEUE)}


def relabel_keeps(rules: list[dict], meta: dict[str, str]) -> bool:
    """Prometheus' `keep` relabelling of a discovered target (anchored regular expressions)."""
    return all(
        re.fullmatch(r["regex"], ";".join(meta.get(s, "") for s in r["source_labels"]))
        for r in rules
        if r.get("action") == "keep"
    )


def targets(workload: dict, namespace: str) -> dict[str, dict[str, str]]:
    """What pod service discovery makes of a workload's pod: one target per container port, by port name."""
    labels = {
        f"__meta_kubernetes_pod_label_{re.sub(r'[^A-Za-z0-9_]', '_', k)}": v
        for k, v in workload["spec"]["template"]["metadata"]["labels"].items()
    }
    return {
        name: {
            **labels,
            "__meta_kubernetes_namespace": namespace,
            "__meta_kubernetes_pod_container_port_name": name,
            "__meta_kubernetes_pod_container_port_number": str(number),
        }
        for name, number in ports(workload).items()
    }


# -- Kueue's metrics endpoint and visibility API -------------------------------------------------------


def test_every_queue_observability_object_validates(stack, manifests, objs):
    ours = [
        m for m in manifests if m["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "kueue-observability"
    ]
    kinds = sorted(m["kind"] for m in ours)
    assert kinds == sorted(
        [
            "Service",
            "Service",
            "ClusterRole",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "RoleBinding",
            "APIService",
            "NetworkPolicy",
        ]
    )
    relay = [m for m in manifests if m["metadata"]["name"] == qm.RELAY]
    assert sorted(m["kind"] for m in relay) == ["Deployment", "ServiceAccount"]
    assert mf.validate([*ours, *relay, controller(objs)], stack.cfg.cluster.kubernetes_version) == []
    # and the checker does check them: an APIService without its group is refused
    broken = {**the(objs, "APIService", "v1beta1.visibility.kueue.x-k8s.io")}
    broken["spec"] = {k: v for k, v in broken["spec"].items() if k != "groupPriorityMinimum"}
    assert mf.validate([broken], stack.cfg.cluster.kubernetes_version) != []


def test_metrics_service_reaches_the_port_kueue_serves_metrics_on(objs):
    deployment, config = controller(objs), kueue_config(objs)
    svc = the(objs, "Service", qm.METRICS_SERVICE, q.CONTROLLER_NAMESPACE)
    assert svc["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    [port] = svc["spec"]["ports"]
    # the configuration's bindAddress is the container port the Service targets, and the relay's URL
    assert ports(deployment)[port["targetPort"]] == int(config["metrics"]["bindAddress"].lstrip(":")) == port["port"]
    [relay] = pod(the(objs, "Deployment", qm.RELAY, q.CONTROLLER_NAMESPACE))["containers"]
    source = relay["args"][relay["args"].index("--source") + 1]
    assert source == f"https://{qm.METRICS_SERVICE}.{q.CONTROLLER_NAMESPACE}.svc:{port['port']}/metrics"


def test_visibility_api_is_on_and_served_by_the_controller(objs):
    deployment, config = controller(objs), kueue_config(objs)
    assert config["featureGates"]["VisibilityOnDemand"] is True
    api = the(objs, "APIService", "v1beta1.visibility.kueue.x-k8s.io")
    assert (api["spec"]["group"], api["spec"]["version"]) == ("visibility.kueue.x-k8s.io", "v1beta1")
    ref = api["spec"]["service"]
    svc = the(objs, "Service", ref["name"], ref["namespace"])
    [port] = svc["spec"]["ports"]
    assert port["port"] == ref.get("port", 443)
    assert ports(deployment)[port["targetPort"]] == 8082  # pkg/visibility/server.go binds 8082
    assert svc["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    # the server writes its self-signed certificate to /tmp: writable although the root filesystem is not
    [c] = pod(deployment)["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    [tmp] = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    [volume] = [v for v in pod(deployment)["volumes"] if v["name"] == tmp["name"]]
    assert "emptyDir" in volume and not tmp.get("readOnly")
    # delegated authentication: the controller's account reads the API server's authentication config
    sa = pod(deployment)["serviceAccountName"]
    reader = the(objs, "RoleBinding", "kueue-visibility-server-auth-reader", "kube-system")
    assert reader["roleRef"]["name"] == "extension-apiserver-authentication-reader"
    assert reader["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": q.CONTROLLER_NAMESPACE}]


def _allows(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    return any(
        group in r.get("apiGroups", []) and resource in r.get("resources", []) and verb in r["verbs"] for r in rules
    )


def test_the_controller_may_check_its_callers(objs):
    [role] = [m for (k, _, n), m in objs.items() if k == "ClusterRole" and n == "kueue-manager-role"]
    rules = role["rules"]
    assert _allows(rules, "authentication.k8s.io", "tokenreviews", "create")  # who calls /metrics, the API
    assert _allows(rules, "authorization.k8s.io", "subjectaccessreviews", "create")  # whether it may
    for resource in ("flowschemas", "prioritylevelconfigurations"):  # the generic API server's APF
        assert _allows(rules, "flowcontrol.apiserver.k8s.io", resource, "watch")


def test_only_the_agent_and_the_relay_read_kueues_metrics(objs):
    reader = the(objs, "ClusterRole", obs.KUEUE_METRICS_READER)
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    binding = the(objs, "ClusterRoleBinding", obs.KUEUE_METRICS_READER)
    assert binding["roleRef"]["name"] == reader["metadata"]["name"]
    agent = the(objs, "Deployment", "cwagent-prometheus", AGENT_NS)
    relay = the(objs, "Deployment", qm.RELAY, q.CONTROLLER_NAMESPACE)
    assert sorted((s["namespace"], s["name"]) for s in binding["subjects"]) == sorted(
        [(AGENT_NS, pod(agent)["serviceAccountName"]), (q.CONTROLLER_NAMESPACE, pod(relay)["serviceAccountName"])]
    )
    # both send their own token: neither pod turns its mounting off
    assert pod(agent).get("automountServiceAccountToken", True) and pod(relay).get("automountServiceAccountToken", True)


def test_network_policy_admits_metrics_from_the_scrapers_only_and_keeps_the_webhooks_open(objs):
    deployment = controller(objs)
    policy = the(objs, "NetworkPolicy", "kueue-controller-manager", q.CONTROLLER_NAMESPACE)
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    by_port = {p["port"]: r for r in policy["spec"]["ingress"] for p in r["ports"]}
    named = ports(deployment)
    # the API server calls the webhooks and the visibility server, the kubelet the probes: from anywhere
    for name in ("webhook-server", "visibility", "health"):
        assert "from" not in by_port[named[name]], name
    metrics = by_port[named["metrics"]]
    relay = the(objs, "Deployment", qm.RELAY, q.CONTROLLER_NAMESPACE)
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": AGENT_NS}}},
        {"podSelector": {"matchLabels": relay["spec"]["template"]["metadata"]["labels"]}},
    ]
    assert set(by_port) == set(named.values())  # every port the controller serves is decided on


# -- the scrape and the declarations ------------------------------------------------------------------


def test_scrape_keeps_each_controllers_metrics_port_and_no_other(objs):
    jobs = scrape_jobs(objs)
    cases = [
        (obs.KUEUE_SCRAPE_JOB, controller(objs), q.CONTROLLER_NAMESPACE),
        (obs.TRAINING_OPERATOR_SCRAPE_JOB, the(objs, "Deployment", "training-operator"), "supernode-system"),
        (obs.QUEUE_WAIT_SCRAPE_JOB, the(objs, "Deployment", qm.RELAY, q.CONTROLLER_NAMESPACE), q.CONTROLLER_NAMESPACE),
    ]
    for job, workload, namespace in cases:
        scrape = jobs[job]
        assert scrape["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": [namespace]}}]
        assert workload["metadata"]["namespace"] == namespace
        found = targets(workload, namespace)
        kept = [name for name, meta in found.items() if relabel_keeps(scrape["relabel_configs"], meta)]
        assert kept == ["metrics"], (job, kept)
        # nobody else's pods: the DCGM exporter's (same namespace as the operator) are not this job's
        dcgm = targets(the(objs, "DaemonSet", "dcgm-exporter"), namespace) if job != obs.KUEUE_SCRAPE_JOB else {}
        assert not [n for n, meta in dcgm.items() if relabel_keeps(scrape["relabel_configs"], meta)]
    kueue = jobs[obs.KUEUE_SCRAPE_JOB]
    assert kueue["scheme"] == "https" and kueue["authorization"] == {
        "type": "Bearer",
        "credentials_file": obs.SERVICE_ACCOUNT_TOKEN,
    }
    assert jobs[obs.TRAINING_OPERATOR_SCRAPE_JOB].get("scheme", "http") == "http"  # the operator serves plain http
    # the agent may list pods where it scrapes them
    bindings = {
        m["metadata"]["namespace"] for (k, _, n), m in objs.items() if k == "RoleBinding" and n.startswith("cwagent")
    }
    assert {q.CONTROLLER_NAMESPACE, "supernode-system"} <= bindings


def _declared(decls: list[dict], job: str, metric: str) -> list[frozenset]:
    """The dimension sets the agent emits `metric` of scrape job `job` with."""
    return [
        frozenset(d)
        for decl in decls
        if re.fullmatch(decl["label_matcher"], job) and decl["source_labels"] == ["job"]
        for s in decl["metric_selectors"]
        if re.search(s, metric)
        for d in decl["dimensions"]
    ]


def test_declarations_carry_the_queue_and_namespace_dimensions(objs):
    decls = declarations(objs)
    kueue = obs.KUEUE_SCRAPE_JOB
    assert frozenset({"ClusterName", "job", "cluster_queue", "status"}) in _declared(decls, kueue, obs.KUEUE_PENDING)
    assert frozenset({"ClusterName", "job", "cluster_queue"}) in _declared(decls, kueue, obs.KUEUE_EVICTED)
    assert frozenset({"ClusterName", "job", "preempting_cluster_queue"}) in _declared(decls, kueue, obs.KUEUE_PREEMPTED)
    for metric in obs.JOB_OUTCOMES:
        assert _declared(decls, obs.TRAINING_OPERATOR_SCRAPE_JOB, metric) == [
            frozenset({"ClusterName", "job", "job_namespace"})
        ]
    assert _declared(decls, obs.QUEUE_WAIT_SCRAPE_JOB, obs.QUEUE_WAIT_P95) == [
        frozenset({"ClusterName", "job", "cluster_queue"})
    ]
    # nothing declares the histogram: the agent would drop it anyway
    assert not _declared(decls, kueue, obs.KUEUE_ADMISSION_WAIT + "_bucket")
    # a declaration of another job does not pick these up
    assert not _declared(decls, obs.TRAINER_SCRAPE_JOB, obs.KUEUE_PENDING)


def test_every_queue_alarm_and_widget_reads_a_series_the_agent_emits(stack, objs):
    decls = declarations(objs)
    found = alarms(stack)
    read = []
    for name, a in found.items():
        if not name.startswith(("queue-wait-", "job-failure-rate-")):
            continue
        if "metricName" in a:
            read.append((a["metricName"], a["dimensions"]))
        for query in a.get("metricQueries") or []:
            if "metric" in query:
                read.append((query["metric"]["metricName"], query["metric"]["dimensions"]))
    body = json.loads(stack.one(T.DASHBOARD).inputs["dashboardBody"])
    for w in body["widgets"]:
        for m in w["properties"]["metrics"]:
            if (
                isinstance(m, list)
                and m[0] == obs.PROMETHEUS_NAMESPACE
                and m[2:4] == ["ClusterName", stack.outputs["cluster_name"]]
            ):
                series = [x for x in m[2:] if not isinstance(x, dict)]
                dims = dict(zip(series[::2], series[1::2]))
                if dims.get("job") in (
                    obs.KUEUE_SCRAPE_JOB,
                    obs.TRAINING_OPERATOR_SCRAPE_JOB,
                    obs.QUEUE_WAIT_SCRAPE_JOB,
                ):
                    read.append((m[1], dims))
    assert len(read) > 8
    for metric, dims in read:
        assert frozenset(dims) in _declared(decls, dims["job"], metric), (metric, dims)
        assert dims["ClusterName"] == stack.outputs["cluster_name"]


# -- the alarms -----------------------------------------------------------------------------------------


class _Series(float):
    """A datapoint in CloudWatch's metric math: division by zero gives no value instead of raising."""

    def __truediv__(self, other):
        return _Series(math.nan) if other == 0 else _Series(float(self) / float(other))

    def __add__(self, other):
        return _Series(float(self) + float(other))


def _evaluate(expression: str, **values: float | None) -> float:
    """CloudWatch's IF and FILL on one datapoint per query (None: no datapoint in the period)."""

    def fill(x, default):
        return _Series(default if x is None else x)

    def if_(condition, then, otherwise):
        return then if condition else otherwise

    def max_(series):
        return max(series)

    python = expression.replace("IF(", "if_(").replace("FILL(", "fill(").replace("MAX(", "max_(")
    return float(eval(python, {"if_": if_, "fill": fill, "max_": max_}, values))


def test_a_wait_alarm_per_training_queue_on_the_relays_window(stack, objs):
    m = stack.cfg.monitoring
    training = {cq for cq in cluster_queues(stack) if obs.is_training_queue(cq)}
    assert training and (stack.cfg.inference is None or cluster_queues(stack) - training)  # prod serves
    found = alarms(stack)
    waits = {n.removeprefix("queue-wait-"): a for n, a in found.items() if n.startswith("queue-wait-")}
    assert set(waits) == training  # the ClusterQueues' real names (gpu-h100, not gpu-H100), serving's not
    [relay] = pod(the(objs, "Deployment", qm.RELAY, q.CONTROLLER_NAMESPACE))["containers"]
    window_s = float(relay["args"][relay["args"].index("--window-s") + 1])
    # the oldest-pending floor is training's priority: experiments (the fabric check) wait by design
    floor = int(relay["args"][relay["args"].index("--min-priority") + 1])
    assert floor == q.PRIORITIES[q.TRAINING][0] > q.PRIORITIES[q.EXPERIMENTS][0]
    threshold = m.queue_wait_p95_minutes * 60
    for cq, a in waits.items():
        queries = {x["id"]: x for x in a["metricQueries"]}
        for qid, metric in (("p95", obs.QUEUE_WAIT_P95), ("oldest", obs.QUEUE_OLDEST_PENDING)):
            got = queries[qid]["metric"]
            assert (got["metricName"], got["stat"]) == (metric, "Maximum")
            assert got["dimensions"] == {
                "ClusterName": stack.outputs["cluster_name"],
                "job": obs.QUEUE_WAIT_SCRAPE_JOB,
                "cluster_queue": cq,
            }
        [out] = [x for x in a["metricQueries"] if x.get("returnData")]
        assert a["threshold"] == threshold == window_s
        assert a["comparisonOperator"] == "GreaterThanOrEqualToThreshold"
        assert a["evaluationPeriods"] == a["datapointsToAlarm"] >= 2
        wait = out["expression"]
        # a queue that admits nothing: p95 0, its oldest pending job past the threshold alarms
        assert _evaluate(wait, p95=0, oldest=threshold + 60) >= threshold
        assert _evaluate(wait, p95=threshold * 2, oldest=None) == threshold * 2  # slow admissions
        assert _evaluate(wait, p95=None, oldest=None) == 0  # the relay away: no wait, no alarm
        assert _evaluate(wait, p95=30, oldest=10) < threshold


def test_the_relay_reads_pending_workloads_and_nothing_else(objs):
    relay = the(objs, "Deployment", qm.RELAY, q.CONTROLLER_NAMESPACE)
    sa = pod(relay)["serviceAccountName"]
    granted = [
        the(objs, "ClusterRole", b["roleRef"]["name"])["rules"]
        for (k, _, _), b in objs.items()
        if k in ("ClusterRoleBinding", "RoleBinding")
        and any(s["name"] == sa and s.get("namespace") == q.CONTROLLER_NAMESPACE for s in b["subjects"])
    ]
    assert sorted(granted, key=str) == sorted(
        [
            [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}],
            [
                {
                    "apiGroups": ["visibility.kueue.x-k8s.io"],
                    "resources": ["clusterqueues/pendingworkloads"],
                    "verbs": ["get"],
                }
            ],
        ],
        key=str,
    )
    [c] = pod(relay)["containers"]
    assert c["command"] == ["python", "-m", "supernode.trainer.queue_wait", "watch"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert relay["spec"]["replicas"] == 1  # two would export every gauge twice


def test_failure_rate_alarm_per_served_namespace_in_metric_math(stack):
    m = stack.cfg.monitoring
    served = {
        r.inputs["metadata"]["namespace"]
        for r in stack.all(T.LOCAL_QUEUE)
        if obs.is_training_queue(r.inputs["spec"]["clusterQueue"])
    }
    found = alarms(stack)
    rates = {n.removeprefix("job-failure-rate-"): a for n, a in found.items() if n.startswith("job-failure-rate-")}
    # the training namespace's, and each team's (prod has two)
    assert (
        set(rates) == served == {stack.cfg.workload.namespace, *(team_names.namespace(t.name) for t in stack.cfg.teams)}
    )
    for namespace, a in rates.items():
        queries = {x["id"]: x for x in a["metricQueries"]}
        [out] = [x for x in a["metricQueries"] if x.get("returnData")]
        for qid, metric in (("failed", obs.JOBS_FAILED), ("succeeded", obs.JOBS_SUCCEEDED)):
            got = queries[qid]["metric"]
            assert (got["metricName"], got["stat"], got["period"]) == (metric, "Sum", m.job_failure_window_hours * 3600)
            assert got["dimensions"]["job_namespace"] == namespace
        assert a["threshold"] == m.job_failure_rate_max and a["comparisonOperator"] == "GreaterThanThreshold"
        rate = out["expression"]
        assert _evaluate(rate, failed=1, succeeded=3) == pytest.approx(0.25)  # at the threshold: no alarm
        assert _evaluate(rate, failed=2, succeeded=2) == pytest.approx(0.5)
        assert _evaluate(rate, failed=2, succeeded=None) == 1.0  # only failures in the window
        assert _evaluate(rate, failed=None, succeeded=None) == 0.0  # nothing finished: no alarm
        assert a["treatMissingData"] == "notBreaching"


def test_team_queues_name_the_teams_queues_as_the_cluster_does():
    assert obs.team_queues(["H100"], "training") == [obs.TeamQueue(None, q.queue_name("H100"), "training")]
    # With teams there is no gpu-h100 training queue: the stack's own job waits in the first team's.
    assert obs.team_queues(["H100"], "training", teams=["research", "platform"]) == [
        obs.TeamQueue("research", "gpu-h100-research", "team-research"),
        obs.TeamQueue("platform", "gpu-h100-platform", "team-platform"),
        obs.TeamQueue("research", "gpu-h100-research", "training"),
    ]


def test_dashboard_shows_wait_pending_evictions_and_outcomes(stack):
    body = json.loads(stack.one(T.DASHBOARD).inputs["dashboardBody"])
    by_title = {w["properties"]["title"]: w["properties"] for w in body["widgets"]}
    training = sorted(cq for cq in cluster_queues(stack) if obs.is_training_queue(cq))

    def dims(metrics: list) -> list[dict]:
        return [dict(zip(m[2:-1:2], m[3:-1:2])) | {"metric": m[1]} for m in metrics]

    title = "Queue wait (s): admission p95, oldest pending"
    wait = dims(by_title[title]["metrics"])
    assert sorted((d["cluster_queue"], d["metric"]) for d in wait) == [
        (cq, metric) for cq in training for metric in sorted((obs.QUEUE_OLDEST_PENDING, obs.QUEUE_WAIT_P95))
    ]
    assert by_title[title]["annotations"]["horizontal"][0]["value"] == stack.cfg.monitoring.queue_wait_p95_minutes * 60
    pending = dims(by_title["Pending workloads"]["metrics"])
    assert sorted((d["cluster_queue"], d["status"]) for d in pending) == [
        (cq, s) for cq in training for s in ("active", "inadmissible")
    ]
    churn = dims(by_title["Evictions and preemptions"]["metrics"])
    assert {(d["metric"], d.get("cluster_queue") or d.get("preempting_cluster_queue")) for d in churn} == {
        (metric, cq) for cq in training for metric in (obs.KUEUE_EVICTED, obs.KUEUE_PREEMPTED)
    }
    outcomes = dims(by_title["Job outcomes"]["metrics"])
    served = [stack.cfg.workload.namespace, *(team_names.namespace(t.name) for t in stack.cfg.teams)]
    assert {(d["metric"], d["job_namespace"]) for d in outcomes} == {
        (metric, ns) for metric in obs.JOB_OUTCOMES for ns in served
    }
    assert all(m[-1]["stat"] == "Sum" for m in by_title["Job outcomes"]["metrics"])  # counts, not means
