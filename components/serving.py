"""The serving workload: vLLM on the training run's export, sized by the Plan's inference plan.

- **Where the weights come from.** `supernode export` writes the model directory to FSx at
  `inference.weightsPrefix` (FSx is linked to the stack's bucket, so it is in S3 as well). An init
  container copies it from the read-only FSx mount to the pod's local disk and verifies every file
  against manifest.json (sha256; the manifest itself against `inference.manifestSha256` when set):
  a mismatch fails the pod before vLLM starts (checklist item 7, the `serving-weights-verified`
  policy). vLLM then serves the local copy offline (`HF_HUB_OFFLINE`: nothing is downloaded).
- **Kind.** A Deployment when one replica (tp x pp GPUs) fits a node; a LeaderWorkerSet when it
  spans nodes (one leader + workers per replica, scheduled as a group; CRD shipped in crds/).
- **Health.** Startup, readiness and liveness probes on vLLM's `/health`; a Service in front.
- **Autoscaling.** An HPA (autoscaling/v2) between replicasMin and replicasMax on the pods metric
  `vllm_requests_in_flight` (vLLM's `vllm:num_requests_running + vllm:num_requests_waiting`,
  exposed by a Prometheus adapter rule, `ADAPTER_RULE`), target `targetRunningPerReplica`. Why HPA
  over KEDA: the HPA is core Kubernetes (validated against the cluster's own schemas, no extra
  controller or CRD), and with an adapter it reads the same signal KEDA's Prometheus scaler would.
- **Sharing the GPU pool with training** (the rule): serving pods run at PriorityClass
  `supernode-serving` (above `supernode-training`) and in Kueue's serving priority, so when the pool
  is full serving preempts training, which checkpoints on SIGTERM and resumes when GPUs free up;
  a ResourceQuota caps serving at `gpuQuota` GPUs (default replicasMax x GPUs per replica), so
  serving can never take more of the pool than that.
- **Access.** A NetworkPolicy admits only pods of `allowedClientNamespaces` (and the metrics
  scraper) to the server port; egress is DNS and the replica's own pods only. A PodDisruptionBudget
  keeps all but one replica up through node drains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pulumi
import pulumi_kubernetes as k8s

from supernode.core.config.schema import Inference
from supernode.core.inference import InferencePlan
from supernode.core.plan import Plan

from .workload_common import GpuNodes, dns_name, gib, load_crd, meta

PORT = 8000
PRIORITY_CLASS = "supernode-serving"
PRIORITY_VALUE = 200000  # above supernode-training (100000, workload_namespace.py)
MODELS = "/models"  # the verified local copy vLLM serves
FSX_MOUNT = "/fsx"
VERIFY_CONFIGMAP = "weights-verify"
METRICS_NAMESPACES = ("amazon-cloudwatch", "monitoring")  # scrapers of /metrics
HPA_METRIC = "vllm_requests_in_flight"
# The Prometheus adapter rule behind HPA_METRIC (install the adapter with this rule).
ADAPTER_RULE = {"seriesQuery": 'vllm:num_requests_running{namespace!="",pod!=""}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                "name": {"as": HPA_METRIC},
                "metricsQuery": "sum(vllm:num_requests_running{<<.LabelMatchers>>} + "
                                "vllm:num_requests_waiting{<<.LabelMatchers>>}) by (<<.GroupBy>>)"}

# Runs in the init container (the vLLM image's Python, standard library only): copy, then verify.
VERIFY_SCRIPT = r'''
import hashlib, json, os, shutil, sys
src, dst, pin = sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else "")
def sha(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 22), b""):
            h.update(b)
    return h.hexdigest()
man = os.path.join(src, "manifest.json")
if not os.path.isfile(man):
    sys.exit(f"weights: no manifest.json in {src}")
if pin and sha(man) != pin:
    sys.exit(f"weights: {man} sha256 {sha(man)} is not the pinned {pin}")
files = json.load(open(man))["files"]
os.makedirs(dst, exist_ok=True)
for name, entry in sorted(files.items()):
    shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    got = sha(os.path.join(dst, name))
    if got != entry["sha256"]:
        sys.exit(f"weights: {name} sha256 {got} does not match manifest.json ({entry['sha256']}): not serving")
shutil.copyfile(man, os.path.join(dst, "manifest.json"))
print(f"weights: {len(files)} files verified against manifest.json")
'''


@dataclass(frozen=True)
class ServingArgs:
    plan: Plan  # plan.inference: the inference plan (must be set)
    inference: Inference
    gpu_nodes: GpuNodes
    fsx_id: pulumi.Input[str]
    fsx_dns_name: pulumi.Input[str]
    fsx_mount_name: pulumi.Input[str]
    queue_labels: Optional[dict[str, str]] = None  # Kueue LocalQueue and priority (components/queues.py)


def server_args(ip: InferencePlan, inf: Inference, name: str) -> list[str]:
    """vLLM's flags: the same as `supernode serve --local` (supernode/ops/serve.py), for a GPU."""
    return ["--model", MODELS, "--served-model-name", name, "--dtype", {"bf16": "bfloat16", "fp16": "float16",
            "fp32": "float32"}[ip.dtype], "--max-model-len", str(ip.max_seq_len), "--max-num-seqs",
            str(ip.max_concurrency), "--tensor-parallel-size", str(ip.tp), "--pipeline-parallel-size", str(ip.pp),
            # the planner's headroom rule: vLLM may use HBM less parallel.hbmHeadroom
            "--gpu-memory-utilization", f"{ip.usable_hbm_gib / ip.hbm_gib:.2f}",
            "--host", "0.0.0.0", "--port", str(PORT)]


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": PORT}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


class ServingWorkload(pulumi.ComponentResource):
    def __init__(self, name: str, args: ServingArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("supernode:serving:ServingWorkload", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        plan, inf, ip = args.plan, args.inference, args.plan.inference
        if ip is None:
            raise ValueError("the plan has no inference plan (no inference section)")
        hw = plan.hardware
        ns_name = inf.namespace
        app = dns_name(plan.stack, "vllm")
        labels = {"app.kubernetes.io/name": app, "app.kubernetes.io/component": "serving"}
        gpus_per_pod = min(ip.gpus_per_replica, hw.accelerators)

        self.namespace = k8s.core.v1.Namespace(f"{name}-ns", metadata=meta(ns_name, labels={
            "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/warn": "restricted"}),
            opts=child)
        ns = self.namespace.metadata.name
        self.priority_class = k8s.scheduling.v1.PriorityClass(
            f"{name}-priority", metadata=meta(PRIORITY_CLASS), value=PRIORITY_VALUE, global_default=False,
            preemption_policy="PreemptLowerPriority",
            description="inference serving: preempts training (which checkpoints on SIGTERM and resumes)", opts=child)
        quota = inf.gpu_quota or ip.replicas_max * ip.gpus_per_replica
        self.quota = k8s.core.v1.ResourceQuota(f"{name}-quota", metadata=meta("serving-gpus", ns), spec={
            "hard": {"requests.nvidia.com/gpu": str(quota), "limits.nvidia.com/gpu": str(quota)}}, opts=child)

        size = max(1, int(plan.inference.weights_gib * 1.2) + 1)
        self.volume = k8s.core.v1.PersistentVolume(f"{name}-fsx-pv", metadata=meta(f"{ns_name}-fsx"), spec={
            "capacity": {"storage": gib(size)}, "volumeMode": "Filesystem", "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
            "claimRef": {"namespace": ns_name, "name": "fsx-models"},
            "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": args.fsx_id, "readOnly": True,
                    "volumeAttributes": {"dnsname": args.fsx_dns_name, "mountname": args.fsx_mount_name}}},
            opts=child)
        self.claim = k8s.core.v1.PersistentVolumeClaim(f"{name}-fsx-pvc", metadata=meta("fsx-models", ns), spec={
            "accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": self.volume.metadata.name,
            "resources": {"requests": {"storage": gib(size)}}}, opts=child)
        self.verify_script = k8s.core.v1.ConfigMap(f"{name}-verify", metadata=meta(VERIFY_CONFIGMAP, ns),
                                                   data={"verify.py": VERIFY_SCRIPT}, opts=child)

        # Whole-node share of CPU and memory per GPU, requests = limits (Guaranteed QoS).
        cpu = max(1, plan.pod.cpu * gpus_per_pod // max(1, hw.accelerators))
        mem = max(4, int(plan.pod.memory_gib * gpus_per_pod / max(1, hw.accelerators)))
        amounts = {"nvidia.com/gpu": str(gpus_per_pod), "cpu": str(cpu), "memory": gib(mem)}
        secure = {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
                  "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
        small = {"cpu": "1", "memory": "2Gi"}
        verify = {
            "name": "verify-weights", "image": inf.image, "command": ["python3", "/verify/verify.py"],
            "args": [f"{FSX_MOUNT}/{inf.weights_prefix.strip('/')}", MODELS] + ([inf.manifest_sha256] if inf.manifest_sha256 else []),
            "volumeMounts": [{"name": "fsx", "mountPath": FSX_MOUNT, "readOnly": True},
                             {"name": "models", "mountPath": MODELS}, {"name": "verify", "mountPath": "/verify"}],
            "resources": {"requests": small, "limits": small}, "securityContext": secure}
        server = {
            "name": "vllm", "image": inf.image,
            "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"], "args": server_args(ip, inf, app),
            "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "HOME", "value": "/tmp"}],
            "ports": [{"name": "http", "containerPort": PORT}],
            "startupProbe": _probe("/health", 10, 180),  # up to 30 min to load large weights
            "readinessProbe": _probe("/health", 5, 3),
            "livenessProbe": _probe("/health", 10, 6),
            "resources": {"requests": amounts, "limits": dict(amounts)},
            "volumeMounts": [{"name": "models", "mountPath": MODELS, "readOnly": True},
                             {"name": "shm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}],
            "securityContext": secure}
        pod_labels = {**labels, **(args.queue_labels or {})}
        template = {
            "metadata": {"labels": pod_labels, "annotations": {"prometheus.io/scrape": "true",
                                                               "prometheus.io/port": str(PORT),
                                                               "prometheus.io/path": "/metrics"}},
            "spec": {"priorityClassName": PRIORITY_CLASS, "initContainers": [verify], "containers": [server],
                     "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 60,
                     "securityContext": {"runAsNonRoot": True, "fsGroup": 1000,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "tolerations": args.gpu_nodes.tolerations(), "affinity": args.gpu_nodes.affinity(),
                     "volumes": [{"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-models", "readOnly": True}},
                                 {"name": "models", "emptyDir": {"sizeLimit": gib(size)}},
                                 {"name": "verify", "configMap": {"name": VERIFY_CONFIGMAP}},
                                 {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                                 {"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}}]}}
        workload_meta = meta(app, ns, labels={**labels, **(args.queue_labels or {})})
        depends = pulumi.ResourceOptions(parent=self, depends_on=[self.priority_class, self.quota, self.claim,
                                                                  self.verify_script])
        if ip.workload_kind == "Deployment":
            self.server = k8s.apps.v1.Deployment(f"{name}-server", metadata=workload_meta, spec={
                "replicas": ip.replicas_min, "selector": {"matchLabels": labels},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                "template": template}, opts=depends)
            target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": app}
        else:
            self.crd = k8s.apiextensions.v1.CustomResourceDefinition(f"{name}-lws-crd",
                                                                     **_crd_args(load_crd("leaderworkerset.yaml")),
                                                                     opts=child)
            self.server = k8s.apiextensions.CustomResource(
                f"{name}-server", api_version="leaderworkerset.x-k8s.io/v1", kind="LeaderWorkerSet",
                metadata=workload_meta, spec={
                    "replicas": ip.replicas_min, "startupPolicy": "LeaderReady",
                    "leaderWorkerTemplate": {"size": ip.pods_per_replica, "restartPolicy": "RecreateGroupOnPodRestart",
                                             "leaderTemplate": template, "workerTemplate": _worker(template)}},
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.crd, self.priority_class, self.quota,
                                                                     self.claim, self.verify_script]))
            target = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": app}

        self.service = k8s.core.v1.Service(f"{name}-svc", metadata=meta(app, ns, labels=labels), spec={
            "type": "ClusterIP", "selector": labels, "ports": [{"name": "http", "port": PORT, "targetPort": PORT}]},
            opts=child)
        self.hpa = k8s.autoscaling.v2.HorizontalPodAutoscaler(f"{name}-hpa", metadata=meta(app, ns, labels=labels), spec={
            "scaleTargetRef": target, "minReplicas": ip.replicas_min, "maxReplicas": ip.replicas_max,
            "metrics": [{"type": "Pods", "pods": {"metric": {"name": HPA_METRIC}, "target": {
                "type": "AverageValue", "averageValue": str(inf.target_running_per_replica)}}}],
            # Loading weights takes minutes: scale up promptly, scale down slowly.
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}}, opts=child)
        self.pdb = k8s.policy.v1.PodDisruptionBudget(f"{name}-pdb", metadata=meta(app, ns, labels=labels), spec={
            "maxUnavailable": 1, "selector": {"matchLabels": labels}}, opts=child)
        peers = [{"podSelector": {"matchLabels": labels}}]  # the replica's own pods (LeaderWorkerSet groups)
        self.network_policy = k8s.networking.v1.NetworkPolicy(f"{name}-netpol", metadata=meta(app, ns, labels=labels), spec={
            "podSelector": {"matchLabels": labels}, "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"namespaceSelector": {"matchExpressions": [{
                "key": "kubernetes.io/metadata.name", "operator": "In",
                "values": sorted({*inf.allowed_client_namespaces, *METRICS_NAMESPACES})}]}}],
                "ports": [{"protocol": "TCP", "port": PORT}]}, {"from": peers}],
            "egress": [{"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
                        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
                       {"to": peers}]}, opts=child)
        self.outputs = {"serving_namespace": ns, "serving_service": self.service.metadata.name,
                        "serving_kind": ip.workload_kind}
        self.register_outputs(self.outputs)


def _worker(template: dict[str, Any]) -> dict[str, Any]:
    """A LeaderWorkerSet worker: the same pod (it joins the leader's Ray cluster through vLLM), without
    the HTTP probes, which only the leader answers."""
    spec = dict(template["spec"])
    spec["containers"] = [{k: v for k, v in c.items() if not k.endswith("Probe")} for c in spec["containers"]]
    return {**template, "spec": spec}


def _crd_args(crd: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": crd["metadata"], "spec": crd["spec"]}
