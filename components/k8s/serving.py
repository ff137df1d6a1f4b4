"""The serving workload: the serving backend (supernode.core.serving: vLLM) on the training run's
export, sized by the Plan's inference plan.

- **Where the weights come from.** `supernode export` writes the model directory to FSx at
  `inference.weightsPrefix` (FSx is linked to the stack's bucket, so it is in S3 as well). An init
  container copies it from the read-only FSx mount to the pod's local disk and verifies every file
  against manifest.json (sha256; the manifest itself against `inference.manifestSha256` when set):
  a mismatch fails the pod before the server starts (checklist item 7, the `serving-weights-verified`
  policy). The server then reads the local copy offline (`HF_HUB_OFFLINE`: nothing is downloaded).
- **Kind.** A Deployment when one replica (tp x pp GPUs) fits a node; a LeaderWorkerSet when it
  spans nodes (one leader + workers per replica, scheduled as a group; CRD shipped in crds/).
- **Health.** Startup, readiness and liveness probes on the backend's health path; a Service in front.
- **Autoscaling.** An HPA (autoscaling/v2) between replicasMin and replicasMax on the pods metric
  `vllm_requests_in_flight` (the backend's in-flight gauges, vLLM's `vllm:num_requests_running +
  vllm:num_requests_waiting`, summed by a Prometheus adapter rule, `ADAPTER_RULE`), target
  `targetRunningPerReplica`. Why HPA over KEDA: the HPA is core Kubernetes (validated against the
  cluster's own schemas, no extra controller or CRD), and with an adapter it reads the same signal
  KEDA's Prometheus scaler would.
  The metric's path, installed with serving only (namespace `monitoring`, add-on files in
  components/addons/): a one-replica Prometheus scraping the server's metrics on the serving pods alone
  and keeping only the two gauges the rule reads (so its memory is a few series per pod), and
  prometheus-adapter serving `custom.metrics.k8s.io` (APIService) from it with `ADAPTER_RULE` as
  its only rule. Why not the CloudWatch agent's scrape, which already runs: the HPA reads the
  custom metrics API, which only an adapter in the cluster serves, and CloudWatch's minute-scale
  delivery would slow scaling; training health needs CloudWatch (one alerting path), the HPA does not.
- **Sharing the GPU pool with training** (the rule, docs/architecture.md "How training and serving
  share the accelerators"): serving runs on its reserved share of the pool (the `role: serving` node
  groups), admitted by its own Kueue ClusterQueue (components/k8s/queues.py, from the Plan's
  pool arithmetic); beyond that share it borrows only what training lends, on training's flavor
  (its pods may run on either role's nodes; the admitted flavor's node labels place them), which
  training reclaims.
  Its PriorityClass never preempts (`preemptionPolicy: Never`): the kube-scheduler must not evict a
  training pod to place a serving pod, only Kueue's quota decides. A ResourceQuota caps serving at
  `gpuQuota` GPUs (default replicasMax x GPUs per replica).
- **SLOs in CloudWatch** (issue 38 item 4). The serving Prometheus also keeps vLLM's TTFT and ITL
  histograms, its request counter and queue gauges (`SLO_SERIES`); a second container in its pod, the
  relay supernode.trainer.serving_slo (trainer image), reads them from Prometheus' federation endpoint
  (every serving pod's, summed per model) and exports the p99s, request rate, error ratio and queue
  depth over `monitoring.servingSloWindowMinutes` as gauges, which the CloudWatch agent scrapes (the
  agent drops histograms); the alarms on them are components/aws/monitoring.py's.
- **Access.** A NetworkPolicy admits only pods of `allowedClientNamespaces` (and the metrics
  scraper) to the server port; egress is DNS and the replica's own pods only. A PodDisruptionBudget
  keeps all but one replica up through node drains.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from supernode.core import observability as obs
from supernode.core.config.schema import Inference
from supernode.core.inference import InferencePlan
from supernode.core.observability import METRICS_SCRAPER_NAMESPACE
from supernode.core.plan import Plan
from supernode.core.pools import ROLE_LABEL
from supernode.core.serving import BACKEND, MODELS_DIR, VERIFY_CONTAINER, ServerSpec

from .addons import addon_resource, load_addon_objects, with_config_hash, with_images
from .common import GpuNodes, dns_name, fsx_claim, gib, meta, pod_security_namespace
from .credentials import API_KEY_SECRET, CA_CONFIGMAP, TLS_SECRET, serving_credentials
from .lws import LEADER_ADDRESS, WORKER_INDEX, LwsController

PORT = 8000
GROUP_PORT = 29501  # a multi-node replica's ranks meet the leader here (torch.distributed / vLLM's DP handshake)
TLS_MOUNT = "/etc/serving-tls"  # the server's key and certificate (the Secret serving_tls creates)
SCRAPE_CA_MOUNT = "/etc/serving-ca"  # the serving Prometheus verifies the servers against the CA here
LEADER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on a group's leader pod (set by LWS)
PRIORITY_CLASS = "supernode-serving"
PRIORITY_VALUE = 200000  # above supernode-training (100000, namespace.py)
FSX_MOUNT = "/fsx"
VERIFY_CONFIGMAP = "weights-verify"
MONITORING_NAMESPACE = obs.SERVING_MONITORING_NAMESPACE  # the serving Prometheus, the adapter behind the HPA
METRICS_NAMESPACES = (METRICS_SCRAPER_NAMESPACE, MONITORING_NAMESPACE)  # scrapers of /metrics
PROMETHEUS_FILE, ADAPTER_FILE = "prometheus.yaml", "prometheus-adapter.yaml"
PROMETHEUS_APP = "prometheus"  # the serving Prometheus pod's app.kubernetes.io/name (prometheus.yaml)
PROMETHEUS_CONFIG, ADAPTER_CONFIG = "prometheus.yaml", "config.yaml"  # the files their Deployments read
# The prometheus-adapter rule behind the HPA's metric: the backend's in-flight gauges, summed per pod.
_IN_FLIGHT = " + ".join(f"{series}{{<<.LabelMatchers>>}}" for series in BACKEND.in_flight_series)
ADAPTER_RULE = {
    "seriesQuery": f'{BACKEND.in_flight_series[0]}{{namespace!="",pod!=""}}',
    "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
    "name": {"as": BACKEND.in_flight_metric},
    "metricsQuery": f"sum({_IN_FLIGHT}) by (<<.GroupBy>>)",
}

# Runs in the init container (the server image's Python, standard library only): each file is hashed as
# it is copied (one read of FSx, not a copy and a re-read), several files at once (hashlib and file I/O
# release the GIL): a 700 B model's 1.4 TB export is ~23 min of one core's sha256, ~3 min on 8.
VERIFY_SCRIPT = r"""
import concurrent.futures, hashlib, json, os, shutil, sys
src, dst, pin = sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else "")
def copy(name):
    h = hashlib.sha256()
    with open(os.path.join(src, name), "rb") as r, open(os.path.join(dst, name), "wb") as w:
        for b in iter(lambda: r.read(1 << 24), b""):
            h.update(b)
            w.write(b)
    return h.hexdigest()
man = os.path.join(src, "manifest.json")
if not os.path.isfile(man):
    sys.exit(f"weights: no manifest.json in {src}")
with open(man, "rb") as f:
    got = hashlib.sha256(f.read()).hexdigest()
if pin and got != pin:
    sys.exit(f"weights: {man} sha256 {got} is not the pinned {pin}")
files = json.load(open(man))["files"]
os.makedirs(dst, exist_ok=True)
names = sorted(files)
# Plain names only (supernode.core.files.plain_name): a path would read or write outside the folders.
bad = [n for n in names if not n or "/" in n or "\\" in n or "\0" in n or n in (".", "..")]
if bad:
    sys.exit(f"weights: manifest.json lists {bad[0]!r}, not a plain file name in the folder: not serving")
with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
    for name, got in zip(names, pool.map(copy, names)):
        if got != files[name]["sha256"]:
            sys.exit(f"weights: {name} sha256 {got} does not match manifest.json ({files[name]['sha256']}): not serving")
shutil.copyfile(man, os.path.join(dst, "manifest.json"))
print(f"weights: {len(files)} files verified against manifest.json")
"""


@dataclass(frozen=True)
class ServingArgs:
    plan: Plan  # plan.inference: the inference plan (must be set)
    inference: Inference
    gpu_nodes: GpuNodes
    fsx_id: pulumi.Input[str]
    fsx_dns_name: pulumi.Input[str]
    fsx_mount_name: pulumi.Input[str]
    queue_labels: dict[str, str] | None = None  # Kueue LocalQueue and priority (components/k8s/queues.py)
    addon_images: Mapping[str, str] = field(default_factory=dict)  # supernode:images.addons
    relay_image: str = ""  # the trainer image: the SLO relay supernode.trainer.serving_slo ("" : no relay)
    slo_window_s: int = 300  # the relay's window (monitoring.servingSloWindowMinutes)


def serving_app(stack: str) -> str:
    """The serving workload's name: its Deployment / LeaderWorkerSet, Service and the model name it serves."""
    return dns_name(stack, BACKEND.name)


def server_spec(ip: InferencePlan, name: str, rank: str = "0", tls: bool = True) -> ServerSpec:
    """The server the inference plan sizes, on the verified weights (`supernode serve --local` fills the
    same fields for this machine, supernode/tools/serve.py). A replica over several nodes (a
    LeaderWorkerSet): `rank` is the pod's node rank, "0" for the leader, `$(LWS_WORKER_INDEX)` (the index
    the LeaderWorkerSet webhook puts into the pod's env, expanded by the kubelet) for a worker; every rank
    meets at the leader's address, which the webhook sets as LWS_LEADER_ADDRESS."""
    multi = ip.pods_per_replica > 1
    return ServerSpec(
        model_dir=MODELS_DIR,
        name=name,
        dtype=ip.dtype,
        max_seq_len=ip.max_seq_len,
        max_concurrency=ip.max_seqs_per_engine,  # vLLM's --max-num-seqs is per data-parallel engine
        tp=ip.tp,
        pp=ip.pp,
        dp=ip.dp,
        expert_parallel=ip.layout == "ep",
        nnodes=ip.pods_per_replica,
        node_rank=rank if multi else "0",
        master_addr=f"$({LEADER_ADDRESS})" if multi else None,
        master_port=GROUP_PORT,
        ssl_keyfile=f"{TLS_MOUNT}/tls.key" if tls else None,
        ssl_certfile=f"{TLS_MOUNT}/tls.crt" if tls else None,
        # the planner's headroom rule: the server may use HBM less parallel.hbmHeadroom
        memory_fraction=ip.usable_hbm_gib / ip.hbm_gib,
        host="0.0.0.0",
        port=PORT,
    )


def serving_scrape_config(namespace: str, pod_labels: Mapping[str, str], server_name: str) -> dict[str, Any]:
    """The serving Prometheus' one job: the server's metrics on PORT of the pods with the serving labels
    in the serving namespace, keeping only the series ADAPTER_RULE reads, each labelled `namespace` and
    `pod` (the rule's resource overrides). Over HTTPS, the server's certificate verified against the
    serving CA for `server_name` (the Service's DNS name, which the certificate names; the scrape
    reaches each pod by its IP). The metrics path needs no API key (vLLM guards only its API paths)."""
    selected = [
        {
            "source_labels": [f"__meta_kubernetes_pod_label_{re.sub(r'[^A-Za-z0-9_]', '_', k)}"],
            "action": "keep",
            "regex": re.escape(v),
        }
        for k, v in sorted(pod_labels.items())
    ]
    return {
        "global": {"scrape_interval": "15s", "scrape_timeout": "10s"},  # the HPA re-reads every 15 s
        "scrape_configs": [
            {
                "job_name": BACKEND.name,
                "metrics_path": BACKEND.metrics_path,
                "scheme": "https",
                "tls_config": {"ca_file": f"{SCRAPE_CA_MOUNT}/ca.crt", "server_name": server_name},
                "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [namespace]}}],
                "relabel_configs": [
                    *selected,
                    # one target per pod: the server's port (the init container declares none)
                    {
                        "source_labels": ["__meta_kubernetes_pod_container_port_number"],
                        "action": "keep",
                        "regex": str(PORT),
                    },
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                ],
                "metric_relabel_configs": [
                    {
                        "source_labels": ["__name__"],
                        "action": "keep",
                        "regex": "|".join(map(re.escape, dict.fromkeys((*BACKEND.in_flight_series, *SLO_SERIES)))),
                    }
                ],
            }
        ],
    }


# The series the SLO relay reads, as the scrape stores them (a histogram as its buckets): a few dozen per
# engine, beside the in-flight gauges.
SLO_SERIES = (
    f"{obs.VLLM_TTFT}_bucket",
    f"{obs.VLLM_ITL}_bucket",
    f"{obs.VLLM_REQUEST_SUCCESS}_total",
    obs.VLLM_REQUESTS_WAITING,
    obs.VLLM_REQUESTS_RUNNING,
)
SLO_RELAY_PORT = 9401
SLO_RELAY_INTERVAL_S = 15  # the serving Prometheus' scrape interval: each read sees a new scrape


def slo_relay_container(image: str, prometheus_port: int, window_s: int) -> dict[str, Any]:
    """The relay beside the serving Prometheus, reading its federation endpoint on the pod's loopback
    (plain HTTP inside the pod; the scrape behind it verified each server's certificate)."""
    match = urllib.parse.quote('{__name__=~"' + "|".join(SLO_SERIES) + '"}', safe="")  # names: no regex syntax
    return {
        "name": obs.SERVING_SLO_SCRAPE_JOB,
        "image": image,
        "command": ["python", "-m", "supernode.trainer.serving_slo", "watch"],
        "args": [
            "--source",
            f"http://127.0.0.1:{prometheus_port}/federate?match[]={match}",
            "--window-s",
            str(window_s),
            "--interval-s",
            str(SLO_RELAY_INTERVAL_S),
            "--port",
            str(SLO_RELAY_PORT),
        ],
        "ports": [{"name": "metrics", "containerPort": SLO_RELAY_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}},
        "securityContext": SECURE_CONTAINER,
    }


def adapter_config() -> dict[str, Any]:
    return {"rules": [ADAPTER_RULE]}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    # The kubelet does not verify the certificate of an HTTPS probe: the health path needs no key.
    return {
        "httpGet": {"path": path, "port": PORT, "scheme": "HTTPS"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


SECURE_CONTAINER = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
LWS_API = "leaderworkerset.x-k8s.io/v1"
API_VERSIONS = {"Deployment": "apps/v1", "LeaderWorkerSet": LWS_API}  # by InferencePlan.workload_kind


def serving_priority_class(resource: str, opts: pulumi.ResourceOptions) -> k8s.scheduling.v1.PriorityClass:
    return k8s.scheduling.v1.PriorityClass(
        resource,
        metadata=meta(PRIORITY_CLASS),
        value=PRIORITY_VALUE,
        global_default=False,
        # Kueue's quotas decide who runs (serving's reserved share, what training lends); the scheduler
        # evicting a training pod for a serving pod would strand the training job.
        preemption_policy="Never",
        description="inference serving: scheduled before training and experiments, preempting neither",
        opts=opts,
    )


def gpu_quota(
    resource: str, namespace: pulumi.Input[str], gpus: int, opts: pulumi.ResourceOptions
) -> k8s.core.v1.ResourceQuota:
    return k8s.core.v1.ResourceQuota(
        resource,
        metadata=meta("serving-gpus", namespace),
        spec={"hard": {"requests.nvidia.com/gpu": str(gpus), "limits.nvidia.com/gpu": str(gpus)}},
        opts=opts,
    )


def weights_disk_gib(ip: InferencePlan) -> int:
    """The room for the weights: the FSx claim's size and the pod's local copy (the export and a fifth)."""
    return max(1, int(ip.weights_gib * 1.2) + 1)


def server_resources(plan: Plan, ip: InferencePlan) -> dict[str, Any]:
    """Whole-node share of CPU and memory per GPU, requests = limits (Guaranteed QoS)."""
    accelerators = plan.hardware.accelerators
    gpus_per_pod = min(ip.gpus_per_replica, accelerators)
    cpu = max(1, plan.pod.cpu * gpus_per_pod // max(1, accelerators))
    mem = max(4, int(plan.pod.memory_gib * gpus_per_pod / max(1, accelerators)))
    amounts = {"nvidia.com/gpu": str(gpus_per_pod), "cpu": str(cpu), "memory": gib(mem)}
    return {"requests": amounts, "limits": dict(amounts)}


def verify_container(inf: Inference) -> dict[str, Any]:
    """The init container: VERIFY_SCRIPT copies the export from FSx to the pod's disk and checks it."""
    small = {"cpu": "1", "memory": "2Gi"}
    return {
        "name": VERIFY_CONTAINER,
        "image": inf.image,
        "command": ["python3", "/verify/verify.py"],
        "args": [f"{FSX_MOUNT}/{inf.weights_prefix.strip('/')}", MODELS_DIR]
        + ([inf.manifest_sha256] if inf.manifest_sha256 else []),
        "volumeMounts": [
            {"name": "fsx", "mountPath": FSX_MOUNT, "readOnly": True},
            {"name": "models", "mountPath": MODELS_DIR},
            {"name": "verify", "mountPath": "/verify"},
        ],
        "resources": {"requests": small, "limits": small},
        "securityContext": SECURE_CONTAINER,
    }


def server_container(plan: Plan, inf: Inference, ip: InferencePlan, app: str, rank: str = "0") -> dict[str, Any]:
    """The backend on the verified local copy, offline, over TLS with the API key from its Secret. A
    worker of a multi-node replica (`rank` not "0") runs headless: no HTTP port, so no probes; the
    leader's readiness (the health path answers once the engine runs, which needs every rank joined)
    stands for the group, and a worker that dies takes the group down (RecreateGroupOnPodRestart)."""
    leader = rank == "0"
    spec = server_spec(ip, app, rank)
    env = [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HOME", "value": "/tmp"},
        {"name": BACKEND.api_key_env, "valueFrom": {"secretKeyRef": {"name": API_KEY_SECRET, "key": "api-key"}}},
    ]
    probes = {
        "startupProbe": _probe(BACKEND.health_path, 10, 180),  # up to 30 min to load large weights
        "readinessProbe": _probe(BACKEND.health_path, 5, 3),
        "livenessProbe": _probe(BACKEND.health_path, 10, 6),
    }
    return {
        "name": BACKEND.name,
        "image": inf.image,
        "command": BACKEND.command() if leader else BACKEND.group_command(),
        "args": BACKEND.flags(spec),
        "env": env,
        **({"ports": [{"name": "https", "containerPort": PORT}], **probes} if leader else {}),
        "resources": server_resources(plan, ip),
        "volumeMounts": [
            {"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True},
        ],
        "securityContext": SECURE_CONTAINER,
    }


def pod_volumes(disk_gib: int) -> list[dict[str, Any]]:
    return [
        {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-models", "readOnly": True}},
        {"name": "models", "emptyDir": {"sizeLimit": gib(disk_gib)}},
        {"name": "verify", "configMap": {"name": VERIFY_CONFIGMAP}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}},
        {"name": "tls", "secret": {"secretName": TLS_SECRET, "defaultMode": 0o440}},
    ]


def pod_template(
    args: ServingArgs, ip: InferencePlan, app: str, labels: Mapping[str, str], rank: str = "0"
) -> dict[str, Any]:
    """A serving pod (a replica's, a LeaderWorkerSet leader's, or with `rank` a worker's): the verifier,
    then the server, on serving's GPU nodes; the leader's metrics annotated for the scrapers."""
    scrape = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": BACKEND.metrics_path,
        "prometheus.io/scheme": "https",
    }
    return {
        "metadata": {"labels": labels, **({"annotations": scrape} if rank == "0" else {})},
        "spec": {
            "priorityClassName": PRIORITY_CLASS,
            "initContainers": [verify_container(args.inference)],
            "containers": [server_container(args.plan, args.inference, ip, app, rank)],
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 60,
            "securityContext": {
                "runAsNonRoot": True,
                "fsGroup": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "tolerations": args.gpu_nodes.tolerations(),
            # Queued, either role's nodes: Kueue puts the admitted flavor's node labels (serving's share,
            # or training's where it borrows what training lends) into the pod's node selector. Unqueued,
            # serving's reserved share only.
            "affinity": args.gpu_nodes.affinity(
                [
                    {
                        "key": ROLE_LABEL,
                        "operator": "In",
                        "values": ["serving", "training"] if args.queue_labels else ["serving"],
                    }
                ]
            ),
            "volumes": pod_volumes(weights_disk_gib(ip)),
        },
    }


def deployment(
    resource: str,
    metadata: dict[str, Any],
    replicas: int,
    selector: Mapping[str, str],
    template: dict[str, Any],
    opts: pulumi.ResourceOptions,
) -> k8s.apps.v1.Deployment:
    """Replicas that each fit a node."""
    return k8s.apps.v1.Deployment(
        resource,
        metadata=metadata,
        spec={
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": template,
        },
        opts=opts,
    )


def leader_worker_set(
    resource: str,
    metadata: dict[str, Any],
    ip: InferencePlan,
    template: dict[str, Any],
    worker: dict[str, Any],
    opts: pulumi.ResourceOptions,
) -> k8s.apiextensions.CustomResource:
    """Replicas that span nodes: a leader and its workers per replica, started and restarted as a group.
    LeaderCreated, not LeaderReady: the leader is ready only once every rank has joined its engine, so
    waiting for it before creating the workers would never end."""
    return k8s.apiextensions.CustomResource(
        resource,
        api_version=LWS_API,
        kind="LeaderWorkerSet",
        metadata=metadata,
        spec={
            "replicas": ip.replicas_min,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": ip.pods_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template,
                "workerTemplate": worker,
            },
        },
        opts=opts,
    )


def cluster_service(
    resource: str,
    app: str,
    namespace: pulumi.Input[str],
    labels: Mapping[str, str],
    opts: pulumi.ResourceOptions,
    leaders_only: bool = False,
) -> k8s.core.v1.Service:
    """The API (HTTPS) in front of the replicas; of a LeaderWorkerSet's, the leaders only (the workers
    serve no HTTP)."""
    selector = {**labels, LEADER_LABEL: "0"} if leaders_only else dict(labels)
    return k8s.core.v1.Service(
        resource,
        metadata=meta(app, namespace, labels=labels),
        spec={
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "https", "port": PORT, "targetPort": PORT}],
        },
        opts=opts,
    )


def autoscaler(
    resource: str,
    metadata: dict[str, Any],
    target: dict[str, str],
    ip: InferencePlan,
    running_per_replica: float,
    opts: pulumi.ResourceOptions,
) -> k8s.autoscaling.v2.HorizontalPodAutoscaler:
    """The HPA on the in-flight requests per pod (ADAPTER_RULE's metric), between replicasMin and replicasMax."""
    return k8s.autoscaling.v2.HorizontalPodAutoscaler(
        resource,
        metadata=metadata,
        spec={
            "scaleTargetRef": target,
            "minReplicas": ip.replicas_min,
            "maxReplicas": ip.replicas_max,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": BACKEND.in_flight_metric},
                        "target": {"type": "AverageValue", "averageValue": str(running_per_replica)},
                    },
                }
            ],
            # Loading weights takes minutes: scale up promptly, scale down slowly.
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
        },
        opts=opts,
    )


def disruption_budget(
    resource: str, app: str, namespace: pulumi.Input[str], labels: Mapping[str, str], opts: pulumi.ResourceOptions
) -> k8s.policy.v1.PodDisruptionBudget:
    """All but one replica stay up through node drains."""
    return k8s.policy.v1.PodDisruptionBudget(
        resource,
        metadata=meta(app, namespace, labels=labels),
        spec={"maxUnavailable": 1, "selector": {"matchLabels": labels}},
        opts=opts,
    )


def serving_network_policy(
    resource: str,
    app: str,
    namespace: pulumi.Input[str],
    labels: Mapping[str, str],
    clients: list[str],
    opts: pulumi.ResourceOptions,
) -> k8s.networking.v1.NetworkPolicy:
    """Ingress to the server port from the `clients` namespaces only; egress DNS and the replica's own pods."""
    peers = [{"podSelector": {"matchLabels": labels}}]  # the replica's own pods (LeaderWorkerSet groups)
    return k8s.networking.v1.NetworkPolicy(
        resource,
        metadata=meta(app, namespace, labels=labels),
        spec={
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {
                                "matchExpressions": [
                                    {"key": "kubernetes.io/metadata.name", "operator": "In", "values": clients}
                                ]
                            }
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": PORT}],
                },
                {"from": peers},
            ],
            "egress": [
                {
                    "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
                    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                },
                {"to": peers},
            ],
        },
        opts=opts,
    )


@dataclass(frozen=True)
class _AddonFiles:
    """Creates the objects of the serving add-on files as children of `parent` (Pulumi names
    `<name>-<kind>-<object name>`), each in the namespace its file places it in: `monitoring`, the
    serving namespace (as "serving") or kube-system."""

    name: str
    parent: pulumi.Resource
    monitoring: pulumi.Output[str]
    serving: pulumi.Input[str]
    images: Mapping[str, str]  # supernode:images.addons

    def create(self, obj: dict[str, Any], **options: Any) -> pulumi.CustomResource:
        md = obj["metadata"]
        namespaces = {MONITORING_NAMESPACE: self.monitoring, "serving": self.serving}
        return addon_resource(
            f"{self.name}-{obj['kind'].lower()}-{md['name'].replace(':', '-')}",
            obj,
            pulumi.ResourceOptions(parent=self.parent, **options),
            namespaces.get(md.get("namespace", "")),
        )

    def install(self, filename: str, config: str, data: str) -> dict[str, Any]:
        """Creates the file's service account, roles and bindings, and the Deployment's ConfigMap
        (`data` as its file `config`); returns the file's objects by kind, the Deployment patched
        (service account, image, configuration) for the caller to create with the rest."""
        loaded = load_addon_objects(filename)
        objs = {o["kind"]: o for o in loaded}  # by kind, for the kinds of one object in the file
        sa = self.create(objs["ServiceAccount"])
        roles = {o["metadata"]["name"]: self.create(o) for o in loaded if o["kind"] == "ClusterRole"}
        for o in loaded:
            if o["kind"] in ("ClusterRoleBinding", "RoleBinding"):
                ref = o["roleRef"]  # ours by their created names; the cluster's (system:...) as named
                ref["name"] = roles[ref["name"]].metadata.name if ref["name"] in roles else ref["name"]
                for subject in o["subjects"]:
                    subject.update(name=sa.metadata.name, namespace=self.monitoring)
                self.create(o)
        deployment = with_config_hash(with_images(objs["Deployment"], self.images), data)
        pod = deployment["spec"]["template"]["spec"]
        pod["serviceAccountName"] = sa.metadata.name
        [volume] = [v for v in pod["volumes"] if "configMap" in v]
        cm = k8s.core.v1.ConfigMap(
            f"{self.name}-{volume['configMap']['name']}",
            data={config: data},
            metadata=meta(volume["configMap"]["name"], self.monitoring),
            opts=pulumi.ResourceOptions(parent=self.parent),
        )
        volume["configMap"]["name"] = cm.metadata.name
        return objs


def point_at_prometheus(
    adapter: dict[str, Any], service: pulumi.Output[str], namespace: pulumi.Output[str], port: int
) -> None:
    """The adapter Deployment's --prometheus-url, at the created Prometheus Service."""
    [server] = adapter["spec"]["template"]["spec"]["containers"]
    server["args"] = [
        pulumi.Output.concat("--prometheus-url=http://", service, ".", namespace, f".svc:{port}/")
        if a.startswith("--prometheus-url=")
        else a
        for a in server["args"]
    ]


def prometheus_policy(
    resource: str,
    namespace: pulumi.Input[str],
    prometheus: dict[str, Any],
    adapter: dict[str, Any],
    port: int,
    opts: pulumi.ResourceOptions,
) -> k8s.networking.v1.NetworkPolicy:
    """Only the adapter reads Prometheus, and only the CloudWatch agent's scrape the SLO relay beside it.
    (The API server reaches the adapter from the control plane.)"""
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": METRICS_SCRAPER_NAMESPACE}}}
    return k8s.networking.v1.NetworkPolicy(
        resource,
        metadata=meta("prometheus", namespace),
        spec={
            "podSelector": {"matchLabels": prometheus["spec"]["selector"]["matchLabels"]},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": adapter["spec"]["selector"]["matchLabels"]}}],
                    "ports": [{"protocol": "TCP", "port": port}],
                },
                {"from": [scraper], "ports": [{"protocol": "TCP", "port": SLO_RELAY_PORT}]},
            ],
        },
        opts=opts,
    )


class ServingWorkload(pulumi.ComponentResource):
    def __init__(self, name: str, args: ServingArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:serving:ServingWorkload", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        plan, inf, ip = args.plan, args.inference, args.plan.inference
        if ip is None:
            raise ValueError("the plan has no inference plan (no inference section)")
        app = serving_app(plan.stack)
        labels = {"app.kubernetes.io/name": app, "app.kubernetes.io/component": "serving"}
        pod_labels = {**labels, **(args.queue_labels or {})}

        self.namespace = pod_security_namespace(f"{name}-ns", inf.namespace, "restricted", "restricted", child)
        ns = self.namespace.metadata.name
        self.priority_class = serving_priority_class(f"{name}-priority", child)
        self.quota = gpu_quota(f"{name}-quota", ns, inf.gpu_quota or ip.replicas_max * ip.gpus_per_replica, child)
        self.claim = fsx_claim(
            name,
            args.fsx_id,
            args.fsx_dns_name,
            args.fsx_mount_name,
            inf.namespace,
            "fsx-models",
            gib(weights_disk_gib(ip)),
            read_only=True,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.namespace]),
        )
        self.verify_script = k8s.core.v1.ConfigMap(
            f"{name}-verify", metadata=meta(VERIFY_CONFIGMAP, ns), data={"verify.py": VERIFY_SCRIPT}, opts=child
        )

        template = pod_template(args, ip, app, pod_labels)
        workload_meta = meta(app, ns, labels=pod_labels)
        service_dns = pulumi.Output.concat(app, ".", ns, ".svc")
        self.credentials, self.tls, self.api_key = serving_credentials(f"{name}-credentials", service_dns, ns, child)
        needs = [self.priority_class, self.quota, self.claim, self.verify_script, self.tls, self.api_key]
        if ip.workload_kind == "Deployment":
            after = pulumi.ResourceOptions(parent=self, depends_on=needs)
            self.server = deployment(f"{name}-server", workload_meta, ip.replicas_min, labels, template, after)
        else:
            # The controller before any LeaderWorkerSet: without it none would ever create a pod.
            self.lws = LwsController(f"{name}-lws", [inf.namespace], args.addon_images, child)
            after = pulumi.ResourceOptions(parent=self, depends_on=[*self.lws.ready, *needs])
            worker = pod_template(args, ip, app, pod_labels, rank=f"$({WORKER_INDEX})")
            self.server = leader_worker_set(f"{name}-server", workload_meta, ip, template, worker, after)
        target = {"apiVersion": API_VERSIONS[ip.workload_kind], "kind": ip.workload_kind, "name": app}

        self.service = cluster_service(
            f"{name}-svc", app, ns, labels, child, leaders_only=ip.workload_kind == "LeaderWorkerSet"
        )
        self.metrics_api = self._autoscaling_metrics(name, args, ns, labels)
        self.hpa = autoscaler(
            f"{name}-hpa",
            meta(app, ns, labels=labels),
            target,
            ip,
            inf.target_running_per_replica,
            pulumi.ResourceOptions(parent=self, depends_on=[self.metrics_api]),
        )
        self.pdb = disruption_budget(f"{name}-pdb", app, ns, labels, child)
        clients = sorted({*inf.allowed_client_namespaces, *METRICS_NAMESPACES})
        self.network_policy = serving_network_policy(f"{name}-netpol", app, ns, labels, clients, child)
        self.outputs = {
            "serving_namespace": ns,
            "serving_service": self.service.metadata.name,
            "serving_kind": ip.workload_kind,
            "serving_ca": self.credentials.ca_pem,  # clients verify the server against it
            "serving_api_key": self.credentials.api_key,  # a secret output
        }
        self.register_outputs(self.outputs)

    def _autoscaling_metrics(
        self, name: str, args: ServingArgs, serving_ns: pulumi.Input[str], pod_labels: Mapping[str, str]
    ) -> pulumi.CustomResource:
        """The serving Prometheus and prometheus-adapter (namespace `monitoring`) from their add-on files,
        each object's references pointed at the created objects (so Pulumi orders them), the images of
        supernode:images.addons, and each Deployment's ConfigMap built here. Returns the APIService."""
        child = pulumi.ResourceOptions(parent=self)
        self.monitoring_namespace = pod_security_namespace(
            f"{name}-monitoring-ns", MONITORING_NAMESPACE, "restricted", "restricted", child
        )
        mon = self.monitoring_namespace.metadata.name
        addons = _AddonFiles(name, self, mon, serving_ns, args.addon_images)
        server_name = f"{dns_name(args.plan.stack, BACKEND.name)}.{args.inference.namespace}.svc"
        scrape = serving_scrape_config(args.inference.namespace, pod_labels, server_name)
        prometheus = addons.install(PROMETHEUS_FILE, PROMETHEUS_CONFIG, yaml.safe_dump(scrape, sort_keys=False))
        ca = k8s.core.v1.ConfigMap(
            f"{name}-{CA_CONFIGMAP}",
            data={"ca.crt": self.credentials.ca_pem},
            metadata=meta(CA_CONFIGMAP, mon),
            opts=child,
        )
        pod = prometheus["Deployment"]["spec"]["template"]["spec"]
        pod["volumes"].append({"name": "serving-ca", "configMap": {"name": ca.metadata.name}})
        for c in pod["containers"]:
            c.setdefault("volumeMounts", []).append(
                {"name": "serving-ca", "mountPath": SCRAPE_CA_MOUNT, "readOnly": True}
            )
        port = prometheus["Service"]["spec"]["ports"][0]["port"]
        if args.relay_image:
            pod["containers"].append(slo_relay_container(args.relay_image, port, args.slo_window_s))
        self.prometheus = addons.create(prometheus["Deployment"])
        svc = addons.create(prometheus["Service"])

        adapter = addons.install(ADAPTER_FILE, ADAPTER_CONFIG, yaml.safe_dump(adapter_config(), sort_keys=False))
        point_at_prometheus(adapter["Deployment"], svc.metadata.name, mon, port)
        self.adapter = addons.create(adapter["Deployment"])
        adapter_svc = addons.create(adapter["Service"])
        prometheus_policy(
            f"{name}-prometheus-netpol", mon, prometheus["Deployment"], adapter["Deployment"], port, child
        )
        api = adapter["APIService"]
        api["spec"]["service"].update(name=adapter_svc.metadata.name, namespace=mon)
        return addons.create(api, depends_on=[self.adapter])
