"""The Kueue controller (components/addons/kueue.yaml, supernode.components.k8s.queues.KueueController): without it the
queue labels, quotas and priorities are inert. Its configuration gangs admission (waitForPodsReady with
blockAdmission) and integrates the job kinds the stack queues; its webhooks reach its Service, scoped to the
queued namespaces; its RBAC covers what it writes; it comes before everything it admits; all objects valid."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import yaml
from aws_preview import preview

from supernode.components.k8s import queues as q
from supernode.core import resource_types as T
from supernode.core.plan import build_plan
from supernode.tools import manifests as mf

# Each integration the stack needs and the resource its webhooks intercept (Kueue serves a webhook path
# only for an enabled integration: a webhook for any other kind would fail every request).
INTEGRATIONS = {
    "batch/job": ("batch", "jobs"),
    "kubeflow.org/pytorchjob": ("kubeflow.org", "pytorchjobs"),
    "pod": ("", "pods"),
    "deployment": ("apps", "deployments"),
    "leaderworkerset.x-k8s.io/leaderworkerset": ("leaderworkerset.x-k8s.io", "leaderworkersets"),
}
# Kueue injects its CA into webhook configurations of exactly these names (pkg/util/cert in Kueue).
WEBHOOK_CONFIGURATIONS = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}


def seconds(duration: str) -> int:
    """A Go duration as Kueue's configuration writes it (45m, 1h30m, 90s)."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, duration
    h, m, s = (int(p or 0) for p in parts.groups())
    return 3600 * h + 60 * m + s


def by_kind(manifests: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for m in manifests:
        out.setdefault(m["kind"], []).append(m)
    return out


def controller_objects(manifests: list[dict]) -> dict[str, dict]:
    """The controller's objects by kind (one of each), found by their app label."""
    ours = [m for m in manifests if m["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "kueue"]
    kinds = by_kind(ours)
    assert all(len(v) == 1 for v in kinds.values()), {k: len(v) for k, v in kinds.items()}
    return {k: v[0] for k, v in kinds.items()}


def configuration(objs: dict[str, dict]) -> dict[str, Any]:
    return yaml.safe_load(objs["ConfigMap"]["data"][q.CONFIG_KEY])


def allows(rules: list[dict], group: str, resource: str, verb: str, name: str | None = None) -> bool:
    return any(
        group in r.get("apiGroups", [])
        and resource in r.get("resources", [])
        and verb in r.get("verbs", [])
        and (not r.get("resourceNames") or name in r["resourceNames"])
        for r in rules
    )


@pytest.fixture(scope="module", params=["dev", "prod"])
def stack(request):
    return preview(request.param)


@pytest.fixture(scope="module")
def manifests(stack) -> list[dict]:
    return mf.from_resources(stack.result.resources)


def test_configuration_gangs_admission_and_manages_only_the_queued_namespaces():
    config = q.controller_configuration(["training", "serving"])
    ready = config["waitForPodsReady"]
    assert ready["enable"] is True and ready["blockAdmission"] is True and seconds(ready["timeout"]) > 0
    assert set(config["integrations"]["frameworks"]) == set(INTEGRATIONS)
    assert config["manageJobsWithoutQueueName"] is False  # the gate Job (no queue label) is not queued
    assert config["managedJobsNamespaceSelector"] == q.namespace_selector(["serving", "training"])
    # Kueue refuses a selector that takes in kube-system or its own namespace (and must never block them).
    (expr,) = config["managedJobsNamespaceSelector"]["matchExpressions"]
    assert expr["operator"] == "In" and not {"kube-system", q.CONTROLLER_NAMESPACE} & set(expr["values"])
    assert config["namespace"] == q.CONTROLLER_NAMESPACE
    # Kueue's feature gates that would need CRDs or APIs the stack does not ship are off; the visibility
    # API (pending workloads' positions, served through kueue-observability.yaml's APIService) is on.
    assert config["featureGates"] == {"MultiKueue": False, "ProvisioningACC": False, "VisibilityOnDemand": True}


@pytest.mark.slow  # previews the stack under the mock engine (seconds)
def test_the_controller_runs_with_its_configuration(stack, manifests):
    objs = controller_objects(manifests)
    deployment, config_map = objs["Deployment"], objs["ConfigMap"]
    ns = deployment["metadata"]["namespace"]
    assert ns == q.CONTROLLER_NAMESPACE == config_map["metadata"]["namespace"]
    config = configuration(objs)
    assert config["waitForPodsReady"]["enable"] is True and config["waitForPodsReady"]["blockAdmission"] is True
    assert {"kubeflow.org/pytorchjob", "batch/job"} <= set(config["integrations"]["frameworks"])
    # managed namespaces: exactly those with LocalQueues (training; serving where the stack serves)
    queued = {lq["metadata"]["namespace"] for lq in by_kind(manifests)["LocalQueue"]}
    assert stack.cfg.workload.namespace in queued
    assert config["managedJobsNamespaceSelector"] == q.namespace_selector(sorted(queued))

    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    # it reads the ConfigMap's Configuration: --config names the file the ConfigMap is mounted as
    [config_arg] = [a.split("=", 1)[1] for a in c["args"] if a.startswith("--config=")]
    [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == config_arg]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"] and mount["subPath"] == q.CONFIG_KEY
    # its certificate Secret is the one its configuration names, mounted where the webhook server reads it
    [cert] = [v for v in pod["volumes"] if "secret" in v]
    icm = config["internalCertManagement"]
    assert (
        icm["enable"] is True
        and cert["secret"]["secretName"] == icm["webhookSecretName"] == objs["Secret"]["metadata"]["name"]
    )
    [cert_mount] = [m for m in c["volumeMounts"] if m["name"] == cert["name"]]
    assert cert_mount["mountPath"] == "/tmp/k8s-webhook-server/serving-certs"
    # the probes hit the health port the configuration binds
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports[c["readinessProbe"]["httpGet"]["port"]] == int(config["health"]["healthProbeBindAddress"][1:])
    assert c["image"].startswith("registry.k8s.io/kueue/kueue:v0.11")
    assert deployment["spec"]["replicas"] >= 2  # one lost pod must not block the queued namespaces


@pytest.mark.slow  # previews the stack under the mock engine (seconds)
def test_webhooks_reach_the_service_and_cover_exactly_the_integrations(stack, manifests):
    objs = controller_objects(manifests)
    svc, config = objs["Service"], configuration(objs)
    assert svc["metadata"]["name"] == config["internalCertManagement"]["webhookServiceName"]
    assert svc["spec"]["selector"].items() <= objs["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    (port,) = svc["spec"]["ports"]
    (c,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    target = {p["name"]: p["containerPort"] for p in c["ports"]}[port["targetPort"]]
    assert target == config["webhook"]["port"]
    queued = q.namespace_selector(sorted({lq["metadata"]["namespace"] for lq in by_kind(manifests)["LocalQueue"]}))
    for kind, name in WEBHOOK_CONFIGURATIONS.items():
        assert objs[kind]["metadata"]["name"] == name
        intercepted = set()
        for hook in objs[kind]["webhooks"]:
            service = hook["clientConfig"]["service"]
            assert (service["name"], service["namespace"]) == (svc["metadata"]["name"], svc["metadata"]["namespace"])
            assert service.get("port", 443) == port["port"]
            assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
            groups = {g for rule in hook["rules"] for g in rule["apiGroups"]}
            if groups == {"kueue.x-k8s.io"}:
                assert "namespaceSelector" not in hook  # Kueue's own API, cluster-wide
            else:  # a job kind: only where jobs are queued, never kube-system or the add-ons
                assert hook["namespaceSelector"] == queued, hook["name"]
                intercepted |= {(g, r) for rule in hook["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
        assert intercepted == set(INTEGRATIONS.values())
        assert {INTEGRATIONS[f] for f in config["integrations"]["frameworks"]} == intercepted


@pytest.mark.slow  # previews the stack under the mock engine (seconds)
def test_rbac_grants_what_the_controller_writes_and_no_cluster_wide_secrets(manifests):
    objs = controller_objects(manifests)
    sa = objs["ServiceAccount"]
    subject = {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}
    assert objs["ClusterRoleBinding"]["subjects"] == [subject] == objs["RoleBinding"]["subjects"]
    assert objs["ClusterRoleBinding"]["roleRef"]["name"] == objs["ClusterRole"]["metadata"]["name"]
    assert objs["RoleBinding"]["roleRef"]["name"] == objs["Role"]["metadata"]["name"]
    assert objs["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    cluster = objs["ClusterRole"]["rules"]
    for verb in ("create", "get", "list", "watch", "update", "patch", "delete"):
        assert allows(cluster, "kueue.x-k8s.io", "workloads", verb)
    for verb in ("patch", "update"):
        for status in ("workloads/status", "clusterqueues/status", "localqueues/status"):
            assert allows(cluster, "kueue.x-k8s.io", status, verb)
    assert allows(cluster, "kueue.x-k8s.io", "workloads/finalizers", "update")
    # suspends and resumes the PyTorchJob (and the CronJobs' Jobs), reads its status
    for group, resource in (("kubeflow.org", "pytorchjobs"), ("batch", "jobs")):
        for verb in ("get", "list", "watch", "update", "patch"):
            assert allows(cluster, group, resource, verb)
        assert allows(cluster, group, f"{resource}/status", "update")
    for verb in ("get", "list", "watch", "update", "patch", "delete"):  # the serving pods (pod integration)
        assert allows(cluster, "", "pods", verb)
    assert allows(cluster, "leaderworkerset.x-k8s.io", "leaderworkersets", "watch")
    assert allows(cluster, "kueue.x-k8s.io", "workloadpriorityclasses", "get")
    # The certificate: its own Secret, in its own namespace; the CA into its own webhook configurations.
    assert not any("secrets" in r.get("resources", []) for r in cluster)
    own = objs["Role"]["rules"]
    cert = objs["Secret"]["metadata"]["name"]
    assert allows(own, "", "secrets", "update", cert) and not allows(own, "", "secrets", "update", "other")
    assert allows(own, "coordination.k8s.io", "leases", "update")  # leader election
    for kind, name in WEBHOOK_CONFIGURATIONS.items():
        plural = kind.lower() + "s"
        assert allows(cluster, "admissionregistration.k8s.io", plural, "update", name)
        assert not allows(cluster, "admissionregistration.k8s.io", plural, "update", "some-other-webhook")


@pytest.mark.slow  # previews the stack under the mock engine (seconds)
def test_everything_it_admits_is_created_after_it(stack):
    resources = stack.result.resources
    by_urn = {r.urn: r for r in resources}
    [controller] = [r for r in stack.all(T.DEPLOYMENT) if r.inputs["metadata"]["name"] == "kueue-controller-manager"]

    def after_controller(r) -> bool:
        """Through its dependencies or its components' (a child registers only once its parent has, and a
        component only once what it depends on exists; the engine deletes in the reverse order)."""
        seen, todo = set(), [*r.dependencies, r.parent]
        while todo:
            urn = todo.pop()
            if urn == controller.urn:
                return True
            if urn not in seen and urn in by_urn:
                seen.add(urn)
                todo += [*by_urn[urn].dependencies, by_urn[urn].parent]
        return False

    admitted = [*stack.all(T.PYTORCH_JOB), *stack.all(T.K8S_JOB), *stack.all(T.CRON_JOB)]
    admitted += [r for r in resources if r.type.startswith("kubernetes:kueue.x-k8s.io/")]
    if stack.cfg.inference is not None:
        admitted += [
            r for r in stack.all(T.DEPLOYMENT) if r.inputs["metadata"].get("namespace") == stack.cfg.inference.namespace
        ] + stack.all(T.LEADER_WORKER_SET)
    kinds = {r.type.rsplit(":", 1)[1] for r in admitted}
    assert {
        "PyTorchJob",
        "Job",
        "CronJob",
        "ClusterQueue",
        "LocalQueue",
        "ResourceFlavor",
        "WorkloadPriorityClass",
    } <= kinds
    assert [r.name for r in admitted if not after_controller(r)] == []
    # and the controller after its CRDs (it will not start without them), its RBAC and its webhooks
    deps = set(controller.dependencies)
    crds = {r.urn for r in stack.all(T.CRD) if r.inputs["metadata"]["name"].endswith(".kueue.x-k8s.io")}
    assert len(crds) == len(q.CRD_FILES) and crds <= deps
    for typ in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration", "ClusterRoleBinding", "RoleBinding"):
        assert any(by_urn[u].type.endswith(":" + typ) for u in deps if u in by_urn), typ


@pytest.mark.slow  # previews the stack under the mock engine (seconds)
def test_pods_ready_timeout_covers_the_slowest_legitimate_start():
    """Serving starts slowest: the weights copy from FSx, then vLLM's startup probe budget. A timeout
    below that would evict every serving pod while it loads, for ever."""
    stack = preview("prod")
    objs = controller_objects(mf.from_resources(stack.result.resources))
    timeout_s = seconds(configuration(objs)["waitForPodsReady"]["timeout"])
    plan = build_plan("prod", stack.cfg)
    # prod's replicas span nodes: a LeaderWorkerSet, whose leader carries the probes
    [server] = [
        r
        for r in stack.all(T.DEPLOYMENT) + stack.all(T.LEADER_WORKER_SET)
        if r.inputs["metadata"].get("namespace") == stack.cfg.inference.namespace
        and "vllm" in r.inputs["metadata"]["name"]
    ]
    spec = server.inputs["spec"]
    template = spec["leaderWorkerTemplate"]["leaderTemplate"] if "leaderWorkerTemplate" in spec else spec["template"]
    [vllm] = [c for c in template["spec"]["containers"] if "startupProbe" in c]
    probe = vllm["startupProbe"]
    startup_s = probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    copy_s = plan.inference.weights_gib * 2**30 / (plan.checkpoint.fsx_throughput_mb_s * 1e6)
    assert startup_s >= 30 * 60 and copy_s > 10
    assert timeout_s >= startup_s + copy_s
    # a 700 B bf16 model's weights at the same throughput still fit
    assert timeout_s >= startup_s + 700e9 * 2 / (plan.checkpoint.fsx_throughput_mb_s * 1e6)


@pytest.mark.slow  # previews the stack under the mock engine (seconds)
def test_the_stack_pins_the_controller_image():
    image = "registry.k8s.io/kueue/kueue:v0.11.9@sha256:" + "e" * 64
    stack = preview("dev", "kueue-image", lambda d: d["images"].setdefault("addons", {}).update(kueue=image))
    [controller] = [r for r in stack.all(T.DEPLOYMENT) if r.inputs["metadata"]["name"] == "kueue-controller-manager"]
    assert [c["image"] for c in controller.inputs["spec"]["template"]["spec"]["containers"]] == [image]


@pytest.mark.slow  # previews the stack under the mock engine (seconds)
def test_all_kueue_objects_validate_and_the_workload_crd_merges_status_per_condition(stack, manifests):
    assert mf.validate(manifests, stack.cfg.cluster.kubernetes_version) == []
    crds = {
        m["spec"]["names"]["kind"]: m
        for m in by_kind(manifests)["CustomResourceDefinition"]
        if m["spec"]["group"] == "kueue.x-k8s.io"
    }
    assert set(crds) == {
        "ResourceFlavor",
        "ClusterQueue",
        "LocalQueue",
        "WorkloadPriorityClass",
        "Workload",
        "AdmissionCheck",
        "Cohort",
    }
    # Kueue applies each Workload condition with its own field manager (server-side apply): the list must
    # merge by type, or one manager's apply would replace (or conflict with) the others' conditions.
    status = crds["Workload"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    conditions = status["properties"]["conditions"]
    assert (conditions["x-kubernetes-list-type"], conditions["x-kubernetes-list-map-keys"]) == ("map", ["type"])
    for merged in ("admissionChecks", "reclaimablePods"):
        assert status["properties"][merged]["x-kubernetes-list-map-keys"] == ["name"]
    # a Workload as Kueue writes one for the trainer validates; a broken one does not
    workload = {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "Workload",
        "metadata": {"name": "pytorchjob-train-1a2b3", "namespace": "training"},
        "spec": {
            "queueName": "gpu-h100",
            "priorityClassName": q.TRAINING,
            "priority": 500,
            "priorityClassSource": "kueue.x-k8s.io/workloadpriorityclass",
            "podSets": [
                {
                    "name": "worker",
                    "count": 16,
                    "template": {"spec": {"containers": [{"name": "pytorch", "image": "trainer@sha256:" + "a" * 64}]}},
                }
            ],
        },
        "status": {
            "conditions": [
                {
                    "type": "QuotaReserved",
                    "status": "True",
                    "reason": "QuotaReserved",
                    "message": "",
                    "lastTransitionTime": "2025-01-01T00:00:00Z",
                }
            ]
        },
    }
    version = stack.cfg.cluster.kubernetes_version
    assert mf.validate([crds["Workload"], workload], version) == []
    broken = copy.deepcopy(workload)
    broken["spec"]["podSets"][0]["name"] = "Worker_1"
    broken["spec"]["priorityClassSource"] = "somewhere"
    del broken["spec"]["podSets"][0]["template"]
    problems = {p.path for p in mf.validate([crds["Workload"], broken], version)}
    assert problems == {"spec.podSets.0", "spec.podSets.0.name", "spec.priorityClassSource"}
