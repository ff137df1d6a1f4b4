"""prod's serving group wider than a node, as previewed: the LeaderWorkerSet controller installed before
the LeaderWorkerSet, every rank joining its leader with vLLM's multi-node flags, readiness on the leader
only, and the API behind TLS and an API key with the scrape and the NetworkPolicy kept. (Every object
validates against the Kubernetes and shipped CRD schemas: tests/components/test_workload.py
test_every_manifest_validates, on prod too.)"""

from __future__ import annotations

import yaml
from aws_preview import preview

from supernode.core import resource_types as T
from supernode.core.plan import build_plan
from supernode.core.serving import BACKEND

LWS_NS = "lws-system"
DYNAMIC = "pulumi-python:dynamic:Resource"


def _named(stack, typ: str, name: str):
    [r] = [r for r in stack.all(typ) if r.inputs["metadata"]["name"] == name]
    return r


def _lws(stack):
    [lws] = stack.all(T.LEADER_WORKER_SET)
    return lws


def _containers(lws) -> tuple[dict, dict]:
    group = lws.inputs["spec"]["leaderWorkerTemplate"]
    return tuple(group[r]["spec"]["containers"][0] for r in ("leaderTemplate", "workerTemplate"))


def test_the_controller_is_installed_before_any_leaderworkerset():
    stack = preview("prod")
    controller = _named(stack, T.DEPLOYMENT, "lws-controller-manager")
    lws = _lws(stack)
    assert controller.urn in lws.dependencies  # created (and ready) first
    crd = _named(stack, T.CRD, "leaderworkersets.leaderworkerset.x-k8s.io")
    assert crd.urn in lws.dependencies and crd.urn in controller.dependencies
    by_urn = stack.by_urn
    kinds = {by_urn[u].type.rsplit(":", 1)[-1] for u in controller.dependencies if u in by_urn}
    assert {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration", "ClusterRoleBinding"} <= kinds
    # the names the controller looks its certificate and webhooks up by (hard-coded / its defaults)
    assert _named(stack, T.K8S_SERVICE, "lws-webhook-service").inputs["metadata"]["namespace"] == LWS_NS
    assert _named(stack, "kubernetes:core/v1:Secret", "lws-webhook-server-cert")
    mutating = _named(
        stack,
        "kubernetes:admissionregistration.k8s.io/v1:MutatingWebhookConfiguration",
        "lws-mutating-webhook-configuration",
    )
    validating = _named(
        stack,
        "kubernetes:admissionregistration.k8s.io/v1:ValidatingWebhookConfiguration",
        "lws-validating-webhook-configuration",
    )
    serving_ns = stack.cfg.inference.namespace
    for config in (mutating, validating):
        for hook in config.inputs["webhooks"]:
            assert hook["clientConfig"]["service"] == {
                **hook["clientConfig"]["service"],
                "name": "lws-webhook-service",
                "namespace": LWS_NS,
            }
            on_pods = any("pods" in r["resources"] for r in hook["rules"])
            selector = hook.get("namespaceSelector")
            # the pod webhooks fail closed: scoped to the serving namespace, not every pod of the cluster
            assert (selector["matchExpressions"][0]["values"] == [serving_ns]) if on_pods else selector is None
    # without a replica wider than a node there is no controller
    dev = preview("dev")
    assert not dev.all(T.LEADER_WORKER_SET)
    assert not [r for r in dev.all(T.DEPLOYMENT) if r.inputs["metadata"]["name"] == "lws-controller-manager"]


def test_the_stack_pins_the_controller_image():
    image = "registry.k8s.io/lws/lws:v0.7.0@sha256:" + "d" * 64
    stack = preview("prod", "lws-image", lambda d: d["images"].setdefault("addons", {}).update(lws=image))
    controller = _named(stack, T.DEPLOYMENT, "lws-controller-manager")
    assert [c["image"] for c in controller.inputs["spec"]["template"]["spec"]["containers"]] == [image]


def test_every_rank_joins_its_leader_and_only_the_leader_serves_and_is_probed():
    stack = preview("prod")
    plan = build_plan("prod", stack.cfg).inference
    lws = _lws(stack)
    spec = lws.inputs["spec"]
    assert spec["leaderWorkerTemplate"]["size"] == plan.pods_per_replica == 2
    # the leader is ready only once every rank joined: waiting for it before creating them never ends
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = _containers(lws)

    def flag(c: dict, name: str) -> str:
        return c["args"][c["args"].index(name) + 1]

    for c in (leader, worker):
        assert flag(c, "--nnodes") == "2" and flag(c, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert flag(c, "--data-parallel-size") == str(plan.dp) and "--enable-expert-parallel" in c["args"]
        assert flag(c, "--tensor-parallel-size") == str(plan.tp)
    assert leader["command"] == BACKEND.command() and flag(leader, "--node-rank") == "0"
    assert "--headless" not in leader["args"]
    assert worker["command"] == BACKEND.group_command() and flag(worker, "--node-rank") == "$(LWS_WORKER_INDEX)"
    assert "--headless" in worker["args"]
    assert {"readinessProbe", "startupProbe", "livenessProbe", "ports"} <= set(leader)
    assert not {"readinessProbe", "startupProbe", "livenessProbe", "ports"} & set(worker)
    # the API is the leaders': the Service selects them by the label the controller gives them
    [svc] = [s for s in stack.all(T.K8S_SERVICE) if s.inputs["metadata"]["name"] == lws.inputs["metadata"]["name"]]
    assert svc.inputs["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    # the HPA scales groups
    [hpa] = [h for h in stack.all(T.HPA) if h.inputs["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"]
    assert hpa.inputs["spec"]["minReplicas"] == plan.replicas_min


def test_the_api_is_tls_and_keyed_and_the_scrape_and_networkpolicy_are_kept():
    stack = preview("prod")
    lws = _lws(stack)
    ns = stack.cfg.inference.namespace
    app = lws.inputs["metadata"]["name"]
    leader, worker = _containers(lws)
    secrets = {s.inputs["metadata"]["name"]: s for s in stack.all("kubernetes:core/v1:Secret")}
    tls, key = secrets["serving-tls"], secrets["serving-api-key"]
    assert tls.inputs["type"] == "kubernetes.io/tls" and set(tls.inputs["stringData"]) == {
        "tls.crt",
        "tls.key",
        "ca.crt",
    }
    assert set(key.inputs["stringData"]) == {"api-key"}
    # the certificate names the Service
    [creds] = [r for r in stack.all(DYNAMIC) if "credentials" in r.name]
    assert f"{app}.{ns}.svc" in creds.inputs["dns_names"]
    template = lws.inputs["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    [volume] = [v for v in template["spec"]["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "serving-tls"
    for c in (leader, worker):
        mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls")
        assert c["args"][c["args"].index("--ssl-keyfile") + 1] == f"{mount}/tls.key"
        env = {e["name"]: e for e in c["env"]}
        assert env[BACKEND.api_key_env]["valueFrom"]["secretKeyRef"] == {"name": "serving-api-key", "key": "api-key"}
        assert "--api-key" not in c["args"]  # never on the command line
    assert all(leader[p]["httpGet"]["scheme"] == "HTTPS" for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    # the serving Prometheus scrapes over HTTPS, verifying the server against the CA it mounts
    prometheus = next(d for d in stack.all(T.DEPLOYMENT) if d.inputs["metadata"]["name"] == "prometheus")
    pod = prometheus.inputs["spec"]["template"]["spec"]
    configs = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    [cm] = [
        c
        for c in stack.all(T.CONFIG_MAP)
        if c.inputs["metadata"]["name"] in configs and "prometheus.yaml" in (c.inputs.get("data") or {})
    ]
    [job] = yaml.safe_load(cm.inputs["data"]["prometheus.yaml"])["scrape_configs"]
    assert job["scheme"] == "https" and job["tls_config"]["server_name"] == f"{app}.{ns}.svc"
    [ca_volume] = [v for v in pod["volumes"] if v["name"] == "serving-ca"]
    [ca_cm] = [c for c in stack.all(T.CONFIG_MAP) if c.inputs["metadata"]["name"] == ca_volume["configMap"]["name"]]
    assert set(ca_cm.inputs["data"]) == {"ca.crt"}
    mount = next(m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "serving-ca")
    assert job["tls_config"]["ca_file"] == f"{mount}/ca.crt"
    # the NetworkPolicy still admits only the clients and the scrapers to the API port
    [netpol] = [p for p in stack.all(T.NETWORK_POLICY) if p.inputs["metadata"]["name"] == app]
    first = netpol.inputs["spec"]["ingress"][0]
    allowed = first["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"]
    assert "monitoring" in allowed and set(stack.cfg.inference.allowed_client_namespaces) <= set(allowed)
    assert first["ports"] == [{"protocol": "TCP", "port": 8000}]
