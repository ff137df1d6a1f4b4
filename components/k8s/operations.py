"""Operations in the cluster after day one (issue 18): what runs on a schedule and what feeds the
monitoring. Every object is a typed Kubernetes resource, so `supernode preview --manifests` renders
and validates it.

- **Fabric re-check** (CronJob, `workload.fabricCheckSchedule`): the interconnect gate's Indexed
  Job again, comparing the node-pair matrix with the baseline the first gate recorded on FSx
  (`/baselines/fabric/baseline.json`, exported to s3://BUCKET/baselines/fabric/, a prefix no
  lifecycle rule expires). `supernode.trainer.node.fabric` prints `fabric_regressed_node_count`, which the
  fabric-regressed alarm reads. Queued by Kueue at the experiments priority, so it runs only on
  free GPU nodes and never preempts training. A ConfigMap summarises the baseline.
- **Inventory** (DaemonSet on the GPU nodes, namespace supernode-ops): `supernode.trainer.node.inventory watch`
  keeps each node's first record and the fleet's as ConfigMaps and prints `inventory_drift_count`
  (the inventory-drift alarm) every `workload.inventoryIntervalMinutes`.
- **Node health** (DaemonSet on the NVIDIA nodes, namespace supernode-node-health, Pod Security privileged
  for its read-only hostPath and CAP_SYSLOG): `supernode.trainer.node.agent watch` admits a node that
  joined unchecked, quarantines and replaces broken ones (docs/architecture.md, "Node life cycle"),
  each node judged as its own instance type. The fabric re-check records its verdict on each node it
  measured in the `fabric-verdict` ConfigMap there (its own service account may patch that one object,
  the agents may get it), and the agent quarantines a node named slow.
- **Restore drill** (CronJob, `workload.restoreDrillSchedule`): `supernode drill restore --json`
  from the trainer image, as the trainer's service account (read access to the checkpoints).
- **Checkpoint retention** (CronJob, `workload.checkpointRetentionSchedule`): `supernode checkpoints
  --retain --json` from the trainer image tags each run's checkpoints in S3 milestone or window, which
  the bucket's lifecycle rules act on. Its own service account, whose IRSA role may list the
  checkpoint prefix, read the markers and run.json files and read and write object tags there:
  nothing else (identity.checkpoint_retention_policy).
- **Training-health scrape**: AWS's "CloudWatch agent with Prometheus monitoring" for EKS
  (components/addons/cwagent-prometheus.yaml) and its two ConfigMaps: the trainer pods (by their
  prometheus.io annotations), our DCGM exporter, and the controllers of the queue and the jobs (Kueue's
  https metrics with the agent's token, the training operator's job outcomes; issue 36 item 5,
  components/k8s/queue_metrics.py), as embedded-metric-format metrics in
  ContainerInsights/Prometheus with the dimensions the alarms and dashboard use. The agent lists pods
  only in the namespaces its scrape configuration names and writes only to the Prometheus log group
  (IRSA: identity.metrics_agent_policy). Jobs, namespaces, service account and metric names are the
  observability contract (supernode/core/observability.py), which the alarms read too.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from supernode.core.config import StackConfig
from supernode.core.config import Workload as WorkloadConfig
from supernode.core.cron import longest_gap_s
from supernode.core.observability import (
    DCGM_SCRAPE_JOB,
    KUEUE_SCRAPE_JOB,
    METRIC_DECLARATIONS,
    PROMETHEUS_AGENT,
    PROMETHEUS_NAMESPACE,
    QUEUE_WAIT_SCRAPE_JOB,
    SERVICE_ACCOUNT_TOKEN,
    SERVING_MONITORING_NAMESPACE,
    SERVING_SLO_SCRAPE_JOB,
    TRAINER_SCRAPE_JOB,
    TRAINING_OPERATOR_SCRAPE_JOB,
    insights_log_group,
)
from supernode.core.vendors import VENDORS

from .addons import SYSTEM_NAMESPACE, addon_resource, with_config_hash, with_images
from .common import MESH_LABEL, GpuNodes, bound_role, cron_job, dns_name, irsa, load_addon, meta, pod_security_namespace
from .jobs import (
    BASELINE_MOUNT,
    FABRIC_BASELINE,
    BaselineStore,
    JobArgs,
    fabric_job_spec,
    fabric_mesh,
    fabric_pod_template,
)
from .queues import CONTROLLER_NAMESPACE as KUEUE_NAMESPACE
from .queues import EXPERIMENTS, job_labels
from .serving import PROMETHEUS_APP as SERVING_PROMETHEUS

OPS_NAMESPACE = "supernode-ops"
INVENTORY_SA = "inventory"
# The node health agent's own namespace: it needs a hostPath and CAP_SYSLOG, which Pod Security
# baseline forbids and only privileged admits, so no other pod gets that level with it.
NODE_HEALTH_NAMESPACE, NODE_HEALTH_SA = "supernode-node-health", "node-health"
# The fabric re-check's verdict on each node (supernode.trainer.node.fabric --verdict-configmap), in
# the agents' namespace; the re-check's pods run as FABRIC_SA, which may patch this one ConfigMap.
FABRIC_VERDICT, FABRIC_SA = "fabric-verdict", "fabric-check"
# A node the agent quarantined for the fabric verdict alone (taint supernode.io/unhealthy=fabric, the
# agent's UNHEALTHY_TAINT and finding) still takes the re-check's pod: only a new measurement clears it.
FABRIC_QUARANTINE_TOLERATION = {
    "key": "supernode.io/unhealthy",
    "operator": "Equal",
    "value": "fabric",
    "effect": "NoSchedule",
}
EFA_COUNTERS = "/sys/class/infiniband"
# The ops pods' egress: DNS, and HTTPS to the Kubernetes API (the cluster's private endpoint), STS and
# the AWS APIs their IRSA roles call; never the instance metadata service.
HTTPS_AND_DNS_ONLY = {
    "podSelector": {},
    "policyTypes": ["Ingress", "Egress"],
    "egress": [
        {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
        {
            "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}}],
            "ports": [{"protocol": "TCP", "port": 443}],
        },
    ],
}
STACK_CONFIGMAP, STACK_MOUNT = "supernode-stack", "/etc/supernode-stack"
RETENTION_SA = "checkpoint-retention"  # in the training namespace; its IAM role trusts this name
DRILL_MOUNT = "/restore"  # the drill restores into FSx (drills/): a checkpoint may not fit a node's disk
DCGM_NAMESPACE = SYSTEM_NAMESPACE  # where the add-ons (our DCGM exporter among them) run
# The accelerator exporter's scrape job, named as its pods' app.kubernetes.io/name (components/addons/):
PROMETHEUS_AGENT_FILE = "cwagent-prometheus.yaml"
# The agent's two ConfigMaps, by the names AWS's manifest mounts: what to scrape, what becomes a metric.
SCRAPE_CONFIGMAP, AGENT_CONFIGMAP = "prometheus-config", "prometheus-cwagentconfig"


@dataclass(frozen=True)
class OperationsArgs:
    job: JobArgs  # the gate's: image, GPU nodes, plan, plan ConfigMap, priority class
    workload: WorkloadConfig
    pvc: pulumi.Input[str]  # the FSx claim in the training namespace
    baseline_subpath: str  # the FSx directory exported to s3://BUCKET/baselines/
    service_account: pulumi.Input[str]  # the trainer's (IRSA: reads the checkpoints in S3)
    cluster_name: str
    region: str
    stack_file: str  # the stack's config as the restore drill reads it (stack_file())
    bucket_name: pulumi.Input[str]  # the drill restores from it
    # The IAM role of the CloudWatch agent's Prometheus scrape (identity.ServiceAccountRole).
    metrics_agent_role_arn: pulumi.Input[str]
    # IRSA of the node health agent (identity.node_health_agent_policy); None: no agent (Neuron nodes)
    node_health_role_arn: pulumi.Input[str] | None
    # IRSA of the checkpoint retention CronJob (identity.checkpoint_retention_policy)
    retention_role_arn: pulumi.Input[str]
    addon_images: Mapping[str, str] = field(default_factory=dict)  # supernode:images.addons
    serving: bool = False  # the stack serves: scrape the serving SLO relay (components/k8s/serving.py)


def stack_file(cfg: StackConfig) -> str:
    """The config as a Pulumi.<stack>.yaml (what `supernode drill restore --config` reads)."""
    return yaml.safe_dump({"config": {f"supernode:{k}": v for k, v in cfg.to_mapping().items()}}, sort_keys=False)


def scraped_namespaces(scrape: dict[str, Any]) -> list[str]:
    """Every namespace a Prometheus scrape configuration discovers pods in."""
    return sorted(
        {
            n
            for job in scrape["scrape_configs"]
            for sd in job["kubernetes_sd_configs"]
            for n in sd["namespaces"]["names"]
        }
    )


# The port each controller serves its metrics on, by the name its container gives it (kueue.yaml,
# training-operator.yaml); the scrape keeps that port of the controller's pods, one target per pod.
METRICS_PORT_NAME = "metrics"
# Kueue's metrics are https behind the API server's authentication and authorisation: the agent sends its
# own service account token (bound to kueue-metrics-reader, kueue-observability.yaml) and does not verify
# the certificate the controller generates for itself (no certificate manager in this stack, as
# upstream's ServiceMonitor: insecureSkipVerify).
KUEUE_SCRAPE_AUTH = {
    "scheme": "https",
    "authorization": {"type": "Bearer", "credentials_file": SERVICE_ACCOUNT_TOKEN},
    "tls_config": {"insecure_skip_verify": True},
}


def controller_scrape_job(job: str, namespace: str, app: str, http: dict[str, Any] | None = None) -> dict[str, Any]:
    """A controller's metrics: the pods labelled app.kubernetes.io/name=`app` in `namespace`, on their
    container port named METRICS_PORT_NAME (no annotation: the pinned files' pods carry none)."""
    return {
        "job_name": job,
        **(http or {}),
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [namespace]}}],
        "relabel_configs": [
            {
                "source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
                "action": "keep",
                "regex": app,
            },
            {
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "action": "keep",
                "regex": METRICS_PORT_NAME,
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "Namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod_name"},
        ],
    }


def prometheus_scrape_config(
    training_namespace: str, exporter_job: str = DCGM_SCRAPE_JOB, serving: bool = False
) -> dict[str, Any]:
    """Prometheus scrape jobs: pods that ask for it by annotation in the training namespace, the
    accelerator exporter's pods (`exporter_job`: DCGM's, or neuron-monitor's), the queue's and the
    jobs' controllers (Kueue, the training operator), and with `serving` the SLO relay beside the
    serving Prometheus. Namespace and Hostname become labels (the metrics' dimensions)."""

    def pods(job: str, namespace: str, keep: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "job_name": job,
            "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [namespace]}}],
            "relabel_configs": [
                *keep,
                {
                    "source_labels": ["__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port"],
                    "action": "replace",
                    "regex": r"([^:]+)(?::\d+)?;(\d+)",
                    "replacement": "$1:$2",
                    "target_label": "__address__",
                },
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "Namespace"},
                {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "Hostname"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod_name"},
            ],
        }

    annotated = {
        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
        "action": "keep",
        "regex": "true",
    }
    dcgm = {
        "source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
        "action": "keep",
        "regex": exporter_job,
    }
    return {
        "global": {"scrape_interval": "1m", "scrape_timeout": "10s"},
        "scrape_configs": [
            pods(TRAINER_SCRAPE_JOB, training_namespace, [annotated]),
            pods(exporter_job, DCGM_NAMESPACE, [dcgm, annotated]),
            controller_scrape_job(KUEUE_SCRAPE_JOB, KUEUE_NAMESPACE, "kueue", KUEUE_SCRAPE_AUTH),
            # the queue-wait relay's gauges (components/k8s/queue_metrics.py), plain http
            controller_scrape_job(QUEUE_WAIT_SCRAPE_JOB, KUEUE_NAMESPACE, QUEUE_WAIT_SCRAPE_JOB),
            # plain http, no authentication (controller-runtime's metrics server as the operator starts it)
            controller_scrape_job(TRAINING_OPERATOR_SCRAPE_JOB, DCGM_NAMESPACE, "training-operator"),
            # the serving SLO relay's gauges (a container of the serving Prometheus' pod), plain http
            *(
                [controller_scrape_job(SERVING_SLO_SCRAPE_JOB, SERVING_MONITORING_NAMESPACE, SERVING_PROMETHEUS)]
                if serving
                else []
            ),
        ],
    }


def cloudwatch_agent_config(cluster_name: str, region: str) -> dict[str, Any]:
    return {
        "agent": {"region": region},
        "logs": {
            "metrics_collected": {
                "prometheus": {
                    "cluster_name": cluster_name,
                    "log_group_name": insights_log_group(cluster_name, "prometheus"),
                    "prometheus_config_path": "/etc/prometheusconfig/prometheus.yaml",
                    "emf_processor": {
                        "metric_declaration_dedup": True,
                        "metric_namespace": PROMETHEUS_NAMESPACE,
                        "metric_declaration": METRIC_DECLARATIONS,
                    },
                }
            },
            "force_flush_interval": 5,
        },
    }


def small(cpu: str, memory: str, cpu_limit: str, memory_limit: str) -> dict[str, Any]:
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": {"cpu": cpu_limit, "memory": memory_limit}}


RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}

# A per-node agent's pod: its node's name, and nvidia-smi (and dcgmi) seeing the node's GPUs without
# claiming any (the jobs own them all).
GPU_OBSERVER_ENV = [
    {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
    {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
]


def gpu_daemonset(
    resource_name: str,
    app: str,
    namespace: pulumi.Input[str],
    service_account: pulumi.Input[str],
    gpu: GpuNodes,
    container: dict[str, Any],
    opts: pulumi.ResourceOptions,
    volumes: list[dict[str, Any]] | None = None,
) -> k8s.apps.v1.DaemonSet:
    """One agent pod (`container`) on every GPU node, tolerating the node groups' taints and the node
    health ones (the agents run on, and release, the nodes they quarantine)."""
    labels = {"app.kubernetes.io/name": app}
    return k8s.apps.v1.DaemonSet(
        resource_name,
        metadata=meta(app, namespace, labels),
        spec={
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": service_account,
                    "tolerations": gpu.daemon_tolerations(),
                    "affinity": gpu.affinity(),
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    **({"volumes": volumes} if volumes else {}),
                },
            },
        },
        opts=opts,
    )


def fabric_verdict_max_age_s(fabric_check_schedule: str) -> int:
    """How old a fabric verdict the node agent still acts on: two fabric-check intervals (older ones
    are ignored)."""
    try:
        return 2 * longest_gap_s(fabric_check_schedule)
    except ValueError as e:
        raise pulumi.RunError(f"workload.fabricCheckSchedule: {e}") from None


def node_health_grants(
    training_namespace: str, verdict: k8s.core.v1.ConfigMap
) -> dict[str, tuple[pulumi.Input[str], list[dict[str, Any]]]]:
    """The node agent's namespaced Roles, by where they apply: (namespace, rules)."""
    return {
        # the training pods leave a broken node through the eviction API (it honours any PodDisruptionBudget
        # a user adds; the stack ships none: an elastic job restarts smaller instead)
        training_namespace: (
            training_namespace,
            [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
            ],
        ),
        # a Node's events
        "default": ("default", [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]),
        # the fabric verdict, that one object (its namespace: the Role waits for the ConfigMap)
        NODE_HEALTH_NAMESPACE: (
            verdict.metadata.namespace,
            [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [FABRIC_VERDICT], "verbs": ["get"]}],
        ),
    }


def node_health_container(job: JobArgs, wl: WorkloadConfig, fabric_max_age_s: int) -> dict[str, Any]:
    """The node agent's container: `supernode.trainer.node.agent watch`, reading the node's EFA counters."""
    return {
        "name": "node-health",
        "image": job.image,
        "command": ["python", "-m", "supernode.trainer.node.agent", "watch"],
        "args": [
            # only where a node has no node.kubernetes.io/instance-type label: each is judged as its own type
            "--instance-type",
            job.plan.instance_type,
            "--evict-namespace",
            wl.namespace,
            "--fabric-verdict",
            f"{NODE_HEALTH_NAMESPACE}/{FABRIC_VERDICT}",
            "--fabric-max-age-s",
            str(fabric_max_age_s),
            "--unchecked-nodes",
            wl.unchecked_nodes,
        ],
        "env": GPU_OBSERVER_ENV,
        # dcgmi diag -r 2 runs once per node join: the limit leaves it room
        "resources": small("100m", "256Mi", "1", "1Gi"),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            # dmesg reads the kernel ring buffer through syslog(2), which kernel.dmesg_restrict=1 (the
            # AL2023 AMI's setting) allows only with CAP_SYSLOG in the effective set. Kubernetes grants
            # no ambient capabilities, so a non-root uid (the image's 10001) never has it effective:
            # uid 0 with every capability dropped but SYSLOG, and an unreadable log is a check not run.
            "runAsUser": 0,
            "runAsNonRoot": False,
            "capabilities": {"drop": ["ALL"], "add": ["SYSLOG"]},
        },
        "volumeMounts": [{"name": "infiniband", "mountPath": EFA_COUNTERS, "readOnly": True}],
    }


class Operations(pulumi.ComponentResource):
    def __init__(self, name: str, args: OperationsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:workload:Operations", name, None, opts)
        self._child = pulumi.ResourceOptions(parent=self)
        job, wl = args.job, args.workload
        stack = job.plan.stack
        store = BaselineStore(pvc=args.pvc, subpath=args.baseline_subpath, regression=wl.fabric_regression)

        # Node health first: the fabric re-check records its verdict in the agents' namespace.
        self.node_health, self.fabric_verdict = (
            (None, None)
            if args.node_health_role_arn is None
            else self._node_health(name, job, wl, args.node_health_role_arn)
        )
        self.fabric_check = self._fabric_check(
            name, job, wl, store, dns_name(stack, "fabric-check"), self.fabric_verdict
        )
        self.fabric_summary = k8s.core.v1.ConfigMap(
            f"{name}-fabric-baseline",
            metadata=meta("fabric-baseline", job.namespace),
            data={"summary.json": json.dumps(self._summary(job, wl, args), indent=1)},
            opts=self._child,
        )
        self.inventory = self._inventory(name, job.image, job.gpu_nodes, wl)
        filename = f"Pulumi.{stack}.yaml"  # the stack's config, as the drill and the retention read it
        stack_cm = k8s.core.v1.ConfigMap(
            f"{name}-stack",
            metadata=meta(STACK_CONFIGMAP, job.namespace),
            data={filename: args.stack_file},
            opts=self._child,
        )
        self.restore_drill = self._restore_drill(name, job, wl, args, stack, stack_cm, filename)
        self.checkpoint_retention = self._checkpoint_retention(name, job, wl, args, stack, stack_cm, filename)
        scrape = prometheus_scrape_config(wl.namespace, VENDORS[job.plan.hardware.vendor].scrape_job, args.serving)
        scrape_yaml = yaml.safe_dump(scrape, sort_keys=False)
        agent_json = json.dumps(cloudwatch_agent_config(args.cluster_name, args.region), indent=1)
        self.scrape_config = [
            k8s.core.v1.ConfigMap(
                f"{name}-prometheus-config",
                metadata=meta(SCRAPE_CONFIGMAP, PROMETHEUS_AGENT.namespace),
                data={"prometheus.yaml": scrape_yaml},
                opts=self._child,
            ),
            k8s.core.v1.ConfigMap(
                f"{name}-prometheus-cwagentconfig",
                metadata=meta(AGENT_CONFIGMAP, PROMETHEUS_AGENT.namespace),
                data={"cwagentconfig.json": agent_json},
                opts=self._child,
            ),
        ]
        self.prometheus_agent = self._prometheus_agent(
            name, args, scraped_namespaces(scrape), (scrape_yaml, agent_json)
        )
        self.register_outputs(
            {"fabric_check": self.fabric_check.metadata.name, "inventory": self.inventory.metadata.name}
        )

    @staticmethod
    def _summary(job: JobArgs, wl: WorkloadConfig, args: OperationsArgs) -> dict[str, Any]:
        """Where the baseline is and what it must cover; the baseline file itself names each node
        (instance id, GPU and EFA device counts) and every pair's figures."""
        plan = job.plan
        return {
            "baseline": FABRIC_BASELINE,
            "fsx_directory": "/" + args.baseline_subpath,
            "s3_prefix": f"{args.baseline_subpath}/fabric/",
            "latest_report": f"{BASELINE_MOUNT}/fabric/latest.json",
            "schedule": wl.fabric_check_schedule,
            "regression": wl.fabric_regression,
            "gate_floor_gbytes_s": plan.gate_floor_gbytes_s,
            "nodes": plan.nodes,
            "gpus_per_node": plan.pod.gpus,
            "efa_per_node": plan.pod.efa,
            "instance_type": plan.instance_type,
            "rebaseline": f"delete {FABRIC_BASELINE} (and its S3 copy): the next check records a new one",
        }

    def _fabric_check(
        self,
        name: str,
        job: JobArgs,
        wl: WorkloadConfig,
        store: BaselineStore,
        service: str,
        verdict: k8s.core.v1.ConfigMap | None,
    ) -> k8s.batch.v1.CronJob:
        """`verdict`: the ConfigMap the check records its verdict on each node in (None: no node agent reads it)."""
        mesh = service
        after = fabric_mesh(f"{name}-fabric", job, mesh, self)
        template = fabric_pod_template(job, mesh, service, store, "latest.json")
        if verdict is not None:
            after += self._fabric_verdict_writer(name, job, verdict, template)
        # One fabric check at a time (the CronJob's Forbid): two would measure each other.
        return cron_job(
            f"{name}-fabric-check",
            service,
            job.namespace,
            wl.fabric_check_schedule,
            # Kueue keeps the Job suspended until the pool has free quota for all of its pods.
            {"metadata": {"labels": job_labels(job.plan, EXPERIMENTS)}, "spec": fabric_job_spec(job, template)},
            pulumi.ResourceOptions(parent=self, depends_on=after),
        )

    def _fabric_verdict_writer(
        self, name: str, job: JobArgs, verdict: k8s.core.v1.ConfigMap, template: dict[str, Any]
    ) -> list[pulumi.Resource]:
        """The re-check's pods get a service account that may patch the verdict ConfigMap and nothing
        else (no create, no list: Pulumi made it; resourceNames pins the one object), tolerate a node
        quarantined for the fabric alone (so a check can clear it), and rank 0 records the verdict."""
        child = self._child
        sa = k8s.core.v1.ServiceAccount(f"{name}-fabric-check", metadata=meta(FABRIC_SA, job.namespace), opts=child)
        role, binding = bound_role(
            f"{name}-fabric-verdict",
            "fabric-verdict-writer",
            verdict.metadata.namespace,
            [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [FABRIC_VERDICT], "verbs": ["patch"]}],
            [{"kind": "ServiceAccount", "name": sa.metadata.name, "namespace": job.namespace}],
            child,
        )
        pod = template["spec"]
        pod["serviceAccountName"] = sa.metadata.name
        pod["automountServiceAccountToken"] = True  # rank 0 patches the verdict through the API
        pod["tolerations"] = [*pod["tolerations"], FABRIC_QUARANTINE_TOLERATION]
        [container] = pod["containers"]
        container["args"] = [*container["args"], "--verdict-configmap", f"{NODE_HEALTH_NAMESPACE}/{FABRIC_VERDICT}"]
        return [verdict, role, binding]

    def _inventory(self, name: str, image: str, gpu: GpuNodes, wl: WorkloadConfig) -> k8s.apps.v1.DaemonSet:
        """Own namespace: the training namespace's quota counts one job's pods, and PSA baseline suffices."""
        child = self._child
        ns = pod_security_namespace(f"{name}-ops-ns", OPS_NAMESPACE, "baseline", "restricted", child).metadata.name
        sa = k8s.core.v1.ServiceAccount(f"{name}-inventory", metadata=meta(INVENTORY_SA, ns), opts=child)
        # Create (keep the first record) and read the baselines: no update, so a baseline is never rewritten.
        role, _ = bound_role(
            f"{name}-inventory",
            "inventory-baselines",
            ns,
            [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "get"]}],
            [{"kind": "ServiceAccount", "name": sa.metadata.name, "namespace": ns}],
            child,
        )
        k8s.networking.v1.NetworkPolicy(
            f"{name}-ops-policy",
            metadata=meta("inventory", ns),
            spec=HTTPS_AND_DNS_ONLY,
            opts=child,
        )
        container = {
            "name": "inventory",
            "image": image,
            "command": ["python", "-m", "supernode.trainer.node.inventory", "watch"],
            "args": [
                "--namespace",
                OPS_NAMESPACE,
                "--interval-s",
                str(wl.inventory_interval_minutes * 60),
                "--max-clock-offset-ms",
                f"{wl.max_clock_offset_ms:g}",
            ],
            "env": GPU_OBSERVER_ENV,
            "resources": small("50m", "256Mi", "500m", "1Gi"),
            "securityContext": RESTRICTED,
        }
        return gpu_daemonset(
            f"{name}-inventory",
            "inventory",
            ns,
            sa.metadata.name,
            gpu,
            container,
            pulumi.ResourceOptions(parent=self, depends_on=[role]),
        )

    def _node_health(
        self, name: str, job: JobArgs, wl: WorkloadConfig, role_arn: pulumi.Input[str]
    ) -> tuple[k8s.apps.v1.DaemonSet, k8s.core.v1.ConfigMap]:
        """supernode.trainer.node.agent on every GPU node: taints, evicts and replaces a broken node.
        With it, the (empty) fabric verdict ConfigMap the fabric re-check fills and the agents read."""
        max_age_s = fabric_verdict_max_age_s(wl.fabric_check_schedule)
        child = self._child
        ns = pod_security_namespace(
            f"{name}-node-health-ns", NODE_HEALTH_NAMESPACE, "privileged", "baseline", child
        ).metadata.name
        sa = k8s.core.v1.ServiceAccount(
            f"{name}-node-health",
            metadata=meta(NODE_HEALTH_SA, ns, annotations=irsa(role_arn)),
            opts=child,
        )
        subjects = [{"kind": "ServiceAccount", "name": sa.metadata.name, "namespace": ns}]
        # Nodes are cluster-scoped: the one ClusterRole. Pods, evictions and events are namespaced Roles.
        nodes = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
        node_role, _ = bound_role(f"{name}-node-health", "supernode-node-health", None, nodes, subjects, child)
        # The fabric re-check patches it (only the data: Pulumi must not reset verdicts on `up`).
        verdict = k8s.core.v1.ConfigMap(
            f"{name}-fabric-verdict",
            metadata=meta(FABRIC_VERDICT, ns),
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["data"]),
        )
        roles = [
            bound_role(f"{name}-node-health-{where}", "supernode-node-health", namespace, rules, subjects, child)[0]
            for where, (namespace, rules) in node_health_grants(wl.namespace, verdict).items()
        ]
        k8s.networking.v1.NetworkPolicy(
            f"{name}-node-health-policy",
            metadata=meta("node-health", ns),
            spec=HTTPS_AND_DNS_ONLY,
            opts=child,
        )
        agents = gpu_daemonset(
            f"{name}-node-health",
            "node-health",
            ns,
            sa.metadata.name,
            job.gpu_nodes,  # tolerating its own quarantine taints: it releases the node it quarantined
            node_health_container(job, wl, max_age_s),
            pulumi.ResourceOptions(parent=self, depends_on=[node_role, *roles]),
            volumes=[{"name": "infiniband", "hostPath": {"path": EFA_COUNTERS, "type": "Directory"}}],
        )
        return agents, verdict

    def _prometheus_agent(
        self, name: str, args: OperationsArgs, namespaces: list[str], config: tuple[str, str]
    ) -> pulumi.CustomResource:
        """AWS's cwagent-prometheus on the two ConfigMaps above: its pod-reading ClusterRole bound only
        in the namespaces the scrape discovers pods in; IRSA lets it write the Prometheus log group."""
        objs = load_addon(PROMETHEUS_AGENT_FILE)
        ns, child = PROMETHEUS_AGENT.namespace, self._child

        def create(obj: dict[str, Any], suffix: str = "", namespace: str | None = ns) -> pulumi.CustomResource:
            return addon_resource(
                f"{name}-{obj['kind'].lower()}-{obj['metadata']['name']}{suffix}", obj, child, namespace
            )

        sa_obj = objs["ServiceAccount"]
        sa_obj["metadata"]["name"] = PROMETHEUS_AGENT.name  # the account its IAM role trusts
        sa_obj["metadata"]["annotations"] = irsa(args.metrics_agent_role_arn)
        sa = create(sa_obj)
        role = create(objs["ClusterRole"], namespace=None)
        for scraped in namespaces:
            binding = copy.deepcopy(objs["RoleBinding"])  # one per namespace
            binding["roleRef"]["name"] = role.metadata.name
            binding["subjects"][0].update(name=sa.metadata.name, namespace=ns)
            create(binding, f"-{scraped}", namespace=scraped)
        deployment = with_config_hash(with_images(objs["Deployment"], args.addon_images), *config)
        pod = deployment["spec"]["template"]["spec"]
        pod["serviceAccountName"] = sa.metadata.name
        created = dict(zip((SCRAPE_CONFIGMAP, AGENT_CONFIGMAP), self.scrape_config))
        for volume in pod["volumes"]:  # the agent starts after its configuration exists
            volume["configMap"]["name"] = created[volume["configMap"]["name"]].metadata.name
        return create(deployment)

    def _restore_drill(
        self,
        name: str,
        job: JobArgs,
        wl: WorkloadConfig,
        args: OperationsArgs,
        stack: str,
        cm: k8s.core.v1.ConfigMap,
        filename: str,
    ) -> k8s.batch.v1.CronJob:
        container = {
            "name": "restore-drill",
            "image": job.image,
            "command": ["supernode", "drill", "restore"],
            "args": [
                "--config",
                f"{STACK_MOUNT}/{filename}",
                "--bucket",
                "$(BUCKET)",
                "--dest",
                f"{DRILL_MOUNT}/{stack}",
                "--json",
            ],
            "env": [{"name": "BUCKET", "value": args.bucket_name}],
            "resources": small("1", "4Gi", "2", "12Gi"),
            "securityContext": RESTRICTED,
            "volumeMounts": [
                {"name": "stack", "mountPath": STACK_MOUNT, "readOnly": True},
                {"name": "fsx", "mountPath": DRILL_MOUNT, "subPath": "drills"},
            ],
        }
        pod = {
            "restartPolicy": "Never",
            "serviceAccountName": args.service_account,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container],
            "volumes": [
                {"name": "stack", "configMap": {"name": cm.metadata.name}},
                {"name": "fsx", "persistentVolumeClaim": {"claimName": args.pvc}},
            ],
        }
        # The fabric-mesh label gives the pod the namespace's HTTPS egress (S3, STS); no GPU, no taint toleration.
        return cron_job(
            f"{name}-restore-drill",
            dns_name(stack, "restore-drill"),
            job.namespace,
            wl.restore_drill_schedule,
            {
                "spec": {
                    "backoffLimit": 0,
                    "template": {"metadata": {"labels": {MESH_LABEL: "restore-drill"}}, "spec": pod},
                }
            },
            self._child,
        )

    def _checkpoint_retention(
        self,
        name: str,
        job: JobArgs,
        wl: WorkloadConfig,
        args: OperationsArgs,
        stack: str,
        cm: k8s.core.v1.ConfigMap,
        filename: str,
    ) -> k8s.batch.v1.CronJob:
        """`supernode checkpoints --retain` on a schedule: no GPU, no FSx, only S3 through its own role."""
        sa = k8s.core.v1.ServiceAccount(
            f"{name}-checkpoint-retention",
            metadata=meta(RETENTION_SA, job.namespace, annotations=irsa(args.retention_role_arn)),
            opts=self._child,
        )
        container = {
            "name": "checkpoint-retention",
            "image": job.image,
            "command": ["supernode", "checkpoints"],
            "args": ["--config", f"{STACK_MOUNT}/{filename}", "--bucket", "$(BUCKET)", "--retain", "--json"],
            "env": [{"name": "BUCKET", "value": args.bucket_name}],
            "resources": small("100m", "256Mi", "1", "1Gi"),
            "securityContext": {**RESTRICTED, "readOnlyRootFilesystem": True},
            "volumeMounts": [{"name": "stack", "mountPath": STACK_MOUNT, "readOnly": True}],
        }
        pod = {
            "restartPolicy": "Never",
            "serviceAccountName": sa.metadata.name,
            "securityContext": {
                "seccompProfile": {"type": "RuntimeDefault"},
                "runAsNonRoot": True,
            },  # image: USER 10001
            "containers": [container],
            "volumes": [{"name": "stack", "configMap": {"name": cm.metadata.name}}],
        }
        # The fabric-mesh label gives the pod the namespace's HTTPS egress (S3, STS), as the drill's.
        # One run at a time (the CronJob's Forbid): two taggers would only repeat each other's work.
        return cron_job(
            f"{name}-checkpoint-retention",
            dns_name(stack, "checkpoint-retention"),
            job.namespace,
            wl.checkpoint_retention_schedule,
            {
                "spec": {
                    "backoffLimit": 2,  # a throttled S3 call is worth a retry; the tags are idempotent
                    "template": {"metadata": {"labels": {MESH_LABEL: "checkpoint-retention"}}, "spec": pod},
                }
            },
            self._child,
        )
