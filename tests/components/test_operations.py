"""Operations in the cluster (issue 18): the scheduled fabric check against the deploy-time baseline,
the trainer's metrics endpoint and its scrape, the inventory DaemonSet, the restore-drill CronJob and
the one GPU exporter, each read from the dev preview and checked against what its reader expects."""

from __future__ import annotations

import csv
import json
import re

import pytest
import yaml
from aws_preview import Stack, insights_queries, preview

from supernode.components.aws.monitoring import LogPattern
from supernode.components.k8s.common import load_addon
from supernode.components.k8s.jobs import BASELINE_MOUNT, FABRIC_BASELINE, METRICS_PORT
from supernode.components.k8s.operations import NODE_HEALTH_NAMESPACE, NODE_HEALTH_SA, OPS_NAMESPACE
from supernode.core import observability as obs
from supernode.core import resource_types as T
from supernode.core.config import load_file
from supernode.core.plan import build_plan
from supernode.tools import manifests as mf

pytestmark = pytest.mark.slow  # one preview of the dev program under the mock engine


@pytest.fixture(scope="module")
def stack() -> Stack:
    return preview("dev")


@pytest.fixture(scope="module")
def objects(stack) -> dict[tuple[str, str], dict]:
    return {(m["kind"], m["metadata"]["name"]): m for m in mf.from_resources(stack.result.resources)}


def container(pod_spec: dict) -> dict:
    [c] = pod_spec["containers"]
    return c


def argv(c: dict) -> list[str]:
    return c.get("command", []) + c.get("args", [])


def flag(c: dict, name: str) -> str:
    a = argv(c)
    return a[a.index(name) + 1]


def env(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_gate_records_and_cron_compares_the_fabric_baseline_outside_the_checkpoints(stack, objects):
    wl = stack.cfg.workload
    [gate] = [r.inputs for r in stack.all(T.K8S_JOB)]
    cron = objects[("CronJob", "dev-fabric-check")]
    assert cron["spec"]["schedule"] == wl.fabric_check_schedule and cron["spec"]["concurrencyPolicy"] == "Forbid"
    job = cron["spec"]["jobTemplate"]["spec"]
    for spec in (gate["spec"], job):
        pod = spec["template"]["spec"]
        c = container(pod)
        assert "supernode.trainer.node.fabric" in argv(c) and flag(c, "--baseline") == FABRIC_BASELINE
        assert float(flag(c, "--regression")) == wl.fabric_regression
        [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == BASELINE_MOUNT]
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        # the FSx directory exported to s3://BUCKET/baselines/ (not checkpoints/, which expire)
        assert mount["subPath"] == "baselines" and volume["persistentVolumeClaim"]["claimName"] == "fsx"
        assert env(c)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}  # pairs named by node
        assert spec["completionMode"] == "Indexed" and spec["completions"] == build_plan("dev", stack.cfg).nodes
    assert flag(container(job["template"]["spec"]), "--report") == f"{BASELINE_MOUNT}/fabric/latest.json"
    # the generated Job's rank 0 is found through the pod's job-name label and the headless Service
    c = container(job["template"]["spec"])
    assert env(c)["PET_MASTER_ADDR"] == "$(JOB_NAME)-0.dev-fabric-check"
    assert job["template"]["spec"]["subdomain"] == "dev-fabric-check" in {n for k, n in objects if k == "Service"}
    summary = json.loads(objects[("ConfigMap", "fabric-baseline")]["data"]["summary.json"])
    assert summary["baseline"] == FABRIC_BASELINE and summary["s3_prefix"] == "baselines/fabric/"
    # the scheduled check prints the field the fabric-regressed alarm reads
    assert "fabric_regressed_node_count" in LogPattern.FABRIC_REGRESSED


def test_trainer_serves_metrics_on_the_pod_ip_and_may_be_scraped(stack, objects):
    [job] = [r.inputs for r in stack.all(T.PYTORCH_JOB)]
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    c = container(template["spec"])
    assert flag(c, "--prometheus-port") == str(METRICS_PORT) and flag(c, "--prometheus-addr") == "$(POD_IP)"
    assert env(c)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(METRICS_PORT)
    policy = objects[("NetworkPolicy", "allow-scrape-dev-train")]
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": METRICS_PORT}]
    assert rule["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == "amazon-cloudwatch"
    scrape = yaml.safe_load(objects[("ConfigMap", "prometheus-config")]["data"]["prometheus.yaml"])
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    assert jobs[obs.TRAINER_SCRAPE_JOB]["kubernetes_sd_configs"][0]["namespaces"]["names"] == [
        stack.cfg.workload.namespace
    ]


def _read_metrics(stack) -> list[tuple[str, frozenset]]:
    """(metric, dimension names) of every alarm and dashboard series in the Prometheus namespace."""
    out = []
    for a in stack.all(T.METRIC_ALARM):
        queries = [q["metric"] for q in a.inputs.get("metricQueries") or [] if q.get("metric")]
        for m in [a.inputs, *queries]:
            if m.get("namespace") == obs.PROMETHEUS_NAMESPACE:
                out.append((m["metricName"], frozenset(m["dimensions"])))
        # a Metrics Insights query reads the metrics with exactly its SCHEMA's dimensions
        for q in insights_queries(a.inputs):
            if q["namespace"] == obs.PROMETHEUS_NAMESPACE:
                out.append((q["metric"], q["schema"]))
    body = json.loads(stack.one(T.DASHBOARD).inputs["dashboardBody"])
    for w in body["widgets"]:
        for series in w["properties"]["metrics"]:
            if isinstance(series, list) and series[0] == obs.PROMETHEUS_NAMESPACE:
                names = [s for s in series if not isinstance(s, dict)]  # a trailing dict is rendering options
                out.append((names[1], frozenset(names[2::2])))
    return out


def test_every_prometheus_metric_read_is_declared_with_its_dimensions(stack, objects):
    agent = json.loads(objects[("ConfigMap", "prometheus-cwagentconfig")]["data"]["cwagentconfig.json"])
    emf = agent["logs"]["metrics_collected"]["prometheus"]["emf_processor"]
    assert emf["metric_namespace"] == obs.PROMETHEUS_NAMESPACE and emf["metric_declaration"] == obs.METRIC_DECLARATIONS
    read = _read_metrics(stack)
    assert {"supernode_train_tokens_per_s", "supernode_train_step", obs.GPU_UTIL} <= {m for m, _ in read}
    for metric, dims in read:
        assert any(
            any(re.search(sel, metric) for sel in d["metric_selectors"]) and dims in map(frozenset, d["dimensions"])
            for d in obs.METRIC_DECLARATIONS
        ), (metric, sorted(dims))


def test_one_gpu_exporter_whose_counters_are_the_metrics_read(stack, objects):
    counters = load_addon("dcgm-exporter.yaml")["ConfigMap"]["data"]["counters.csv"]
    fields = {row[0].strip() for row in csv.reader(counters.splitlines()) if row and not row[0].startswith("#")}
    read = {m for m, _ in _read_metrics(stack) if m.startswith("DCGM_")}
    assert read and read <= fields  # the exporter emits each counter under its DCGM field name
    alarm = [a.inputs for a in stack.all(T.METRIC_ALARM) if a.inputs["name"].endswith("gpu-util-low")][0]
    [q] = insights_queries(alarm)
    assert (q["namespace"], q["metric"]) == (obs.PROMETHEUS_NAMESPACE, "DCGM_FI_DEV_GPU_UTIL")
    ds = objects[("DaemonSet", "dcgm-exporter")]["spec"]["template"]["spec"]
    c = container(ds)
    [mount] = [m for m in c["volumeMounts"] if env(c)["DCGM_EXPORTER_COLLECTORS"].startswith(m["mountPath"])]
    assert {v["name"]: v for v in ds["volumes"]}[mount["name"]]["configMap"]["name"] == "dcgm-exporter-counters"
    # the CloudWatch add-on's own GPU collection is off: one exporter
    [addon] = [r.inputs for r in stack.all(T.EKS_ADDON) if r.inputs["addonName"] == "amazon-cloudwatch-observability"]
    kube = json.loads(addon["configurationValues"])["agent"]["config"]["logs"]["metrics_collected"]["kubernetes"]
    assert kube["accelerated_compute_metrics"] is False


def test_inventory_daemonset_on_gpu_nodes_keeps_baselines_it_cannot_rewrite(stack, objects):
    wl = stack.cfg.workload
    ds = objects[("DaemonSet", "inventory")]
    assert ds["metadata"]["namespace"] == OPS_NAMESPACE
    pod = ds["spec"]["template"]["spec"]
    c = container(pod)
    assert argv(c)[:4] == ["python", "-m", "supernode.trainer.node.inventory", "watch"]
    assert flag(c, "--namespace") == OPS_NAMESPACE and flag(c, "--interval-s") == str(
        wl.inventory_interval_minutes * 60
    )
    assert float(flag(c, "--max-clock-offset-ms")) == wl.max_clock_offset_ms
    assert pod["tolerations"] and pod["affinity"]["nodeAffinity"]
    [rule] = objects[("Role", "inventory-baselines")]["rules"]
    assert sorted(rule["verbs"]) == ["create", "get"] and rule["resources"] == ["configmaps"]


def test_node_health_agent_runs_on_every_gpu_node_with_only_the_rights_it_uses(stack, objects):
    wl, plan = stack.cfg.workload, build_plan("dev", stack.cfg)
    ds = objects[("DaemonSet", "node-health")]
    assert ds["metadata"]["namespace"] == NODE_HEALTH_NAMESPACE
    # hostPath and CAP_SYSLOG: only privileged admits them, so the agent is alone in its namespace
    ns = objects[("Namespace", NODE_HEALTH_NAMESPACE)]["metadata"]["labels"]
    assert ns["pod-security.kubernetes.io/enforce"] == "privileged"
    pod = ds["spec"]["template"]["spec"]
    c = container(pod)
    assert argv(c)[:4] == ["python", "-m", "supernode.trainer.node.agent", "watch"]
    assert flag(c, "--instance-type") == plan.instance_type and flag(c, "--evict-namespace") == wl.namespace
    assert env(c)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert c["resources"]["requests"] and c["resources"]["limits"]
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]} and sc["allowPrivilegeEscalation"] is False
    assert "privileged" not in sc
    # CAP_SYSLOG is effective only for uid 0 (Kubernetes grants no ambient capabilities): the image's
    # non-root user would read dmesg refused under kernel.dmesg_restrict=1
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False
    # the stack's policy for a node whose checks did not all run (the dev stack: admit, no DCGM in the image)
    assert flag(c, "--unchecked-nodes") == wl.unchecked_nodes == "admit"
    [mount] = c["volumeMounts"]
    assert mount["readOnly"] is True and mount["mountPath"] == "/sys/class/infiniband"
    [volume] = pod["volumes"]
    assert volume["hostPath"]["path"] == "/sys/class/infiniband"
    # it keeps running on the node it quarantined, and on a node that has not passed its deep check
    tolerated = {t["key"] for t in pod["tolerations"]}
    assert {"supernode.io/unhealthy", "supernode.io/unchecked"} <= tolerated
    assert pod["affinity"]["nodeAffinity"]
    assert pod["serviceAccountName"] == NODE_HEALTH_SA
    # IRSA: the role of identity.node_health_agent_policy (tests/components/test_aws_identity.py)
    sa = objects[("ServiceAccount", NODE_HEALTH_SA)]["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
    assert sa == stack.one(T.IAM_ROLE, "node-health-role").outputs["arn"]

    mine = [m for m in mf.from_resources(stack.result.resources) if m["metadata"]["name"] == "supernode-node-health"]

    def rules(kind: str) -> dict[str | None, list[tuple[str, str, list[str]]]]:
        """Each role of this kind, by namespace, as (group, resource, verbs): the RBAC must be exactly these."""
        return {
            m["metadata"].get("namespace"): sorted(
                (g, res, sorted(r["verbs"])) for r in m["rules"] for g in r["apiGroups"] for res in r["resources"]
            )
            for m in mine
            if m["kind"] == kind
        }

    assert rules("ClusterRole") == {None: [("", "nodes", ["get", "patch"])]}  # nodes are cluster-scoped
    assert rules("Role") == {
        wl.namespace: [("", "pods", ["get", "list"]), ("", "pods/eviction", ["create"])],
        "default": [("", "events", ["create"])],  # where a Node's events go
        # the fabric verdict ConfigMap, by name (tests/components/test_fabric_verdict_rbac.py)
        NODE_HEALTH_NAMESPACE: [("", "configmaps", ["get"])],
    }
    bindings = [m for m in mine if m["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert len(bindings) == 4
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": NODE_HEALTH_SA, "namespace": NODE_HEALTH_NAMESPACE}]


def test_gpu_nodes_join_unchecked_and_only_their_daemonsets_tolerate_it(stack, objects):
    """A new GPU node takes no training or serving pod until the node health agent's deep check passes."""
    unchecked = "supernode.io/unchecked"
    for group in stack.all(T.NODE_GROUP):
        if group.inputs["nodeGroupName"] != "system":
            keys = [t["key"] for t in group.inputs["taints"]]
            assert "nvidia.com/gpu" in keys and unchecked in keys, group.name

    def tolerates(pod: dict, key: str) -> bool:
        return any(t.get("key") == key for t in pod.get("tolerations", []))

    def on_gpu_nodes(pod: dict) -> bool:
        return tolerates(pod, "nvidia.com/gpu")

    daemons = [m for (k, _), m in objects.items() if k == "DaemonSet"]
    gpu_daemons = {m["metadata"]["name"] for m in daemons if on_gpu_nodes(m["spec"]["template"]["spec"])}
    assert gpu_daemons >= {"nvidia-device-plugin", "dcgm-exporter", "inventory", "node-health"}
    for m in daemons:
        pod = m["spec"]["template"]["spec"]
        if on_gpu_nodes(pod):
            assert tolerates(pod, unchecked) and tolerates(pod, "supernode.io/unhealthy"), m["metadata"]["name"]
    job = objects[("PyTorchJob", "dev-train")]
    workloads = [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    workloads.append(objects[("Deployment", "dev-vllm")]["spec"]["template"]["spec"])
    workloads.append(objects[("Job", "dev-fabric-gate")]["spec"]["template"]["spec"])
    for pod in workloads:
        assert on_gpu_nodes(pod) and not tolerates(pod, unchecked) and not tolerates(pod, "supernode.io/unhealthy")


def test_restore_drill_cronjob_runs_the_cli_on_the_stack_file(stack, objects, tmp_path):
    cron = objects[("CronJob", "dev-restore-drill")]
    assert cron["spec"]["schedule"] == stack.cfg.workload.restore_drill_schedule
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    c = container(pod)
    assert argv(c)[:3] == ["supernode", "drill", "restore"] and "--json" in argv(c)
    assert pod["serviceAccountName"] == stack.cfg.workload.service_account  # IRSA: reads the checkpoints
    # the mounted stack file is this stack's config
    path = flag(c, "--config")
    name = path.rsplit("/", 1)[1]
    stack_file = tmp_path / name
    stack_file.write_text(objects[("ConfigMap", "supernode-stack")]["data"][name])
    assert load_file(stack_file) == stack.cfg
    # and the CLI accepts exactly this command line
    from supernode.cli import build_parser

    args = build_parser().parse_args(argv(c)[1:])
    assert args.bucket == "$(BUCKET)" and args.config is not None
