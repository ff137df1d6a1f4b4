"""The observability contract: the names that the trainer, the scrape that reads it and the alarms
and dashboard that watch it must agree on, declared once.

A training-health series travels: the trainer's gauge (trainer/metrics.py registers TRAINER_METRICS)
-> the CloudWatch agent's Prometheus scrape (components/k8s/operations.py), which runs in
METRICS_SCRAPER_NAMESPACE as PROMETHEUS_AGENT and finds the trainer pods as TRAINER_SCRAPE_JOB and our
DCGM exporter as DCGM_SCRAPE_JOB (neuron-monitor as NEURON_SCRAPE_JOB on Trainium) -> a CloudWatch
metric in PROMETHEUS_NAMESPACE, for the series METRIC_DECLARATIONS selects, with its dimensions -> the
alarms and dashboard (components/aws/monitoring.py), which name it by exactly those. A name
typed at one end only is a metric no alarm ever sees; so every
end imports it from here; likewise the alarms' names (by purpose and vendor) and the trainer's log
phrases that the log alarms match. Plain strings, so the core stays free of pulumi.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from supernode.core import teams as team_names


class ServiceAccount(NamedTuple):
    namespace: str
    name: str


# The CloudWatch observability add-on's namespace: its agent and our Prometheus scrape agent run there,
# and the trainer's network policy admits scrapes from it.
METRICS_SCRAPER_NAMESPACE = "amazon-cloudwatch"
# The agents' service accounts, which their IAM roles trust (IRSA): the add-on's (Container Insights) and
# the Prometheus scrape's (components/addons/cwagent-prometheus.yaml).
CLOUDWATCH_AGENT = ServiceAccount(METRICS_SCRAPER_NAMESPACE, "cloudwatch-agent")
PROMETHEUS_AGENT = ServiceAccount(METRICS_SCRAPER_NAMESPACE, "cwagent-prometheus")

# The CloudWatch metric namespace the scrape writes its series to (embedded metric format).
PROMETHEUS_NAMESPACE = "ContainerInsights/Prometheus"
# The scrape jobs; a job's name is the `job` dimension of every series it brings in. The DCGM job keeps
# the pods labelled app.kubernetes.io/name=dcgm-exporter.
TRAINER_SCRAPE_JOB = "supernode-trainer"
DCGM_SCRAPE_JOB = "dcgm-exporter"


def insights_log_group(cluster_name: str, kind: str) -> str:
    """A Container Insights log group: the agents write to it, monitoring creates it first (retention, KMS)."""
    return f"/aws/containerinsights/{cluster_name}/{kind}"


class TrainerMetric(NamedTuple):
    name: str
    help: str
    label: str | None = None  # a series per value (a phase, a MoE layer), and one more dimension


LOSS = TrainerMetric("supernode_train_loss", "training loss (mean over the global batch)")
LR = TrainerMetric("supernode_train_lr", "learning rate")
GRAD_NORM = TrainerMetric("supernode_train_grad_norm", "global gradient norm before clipping")
TOKENS_PER_S = TrainerMetric("supernode_train_tokens_per_s", "tokens per second, all ranks")
FLOPS_PER_S_PER_RANK = TrainerMetric("supernode_train_flops_per_s_per_rank", "achieved training FLOP/s per rank")
MFU = TrainerMetric("supernode_train_mfu", "model FLOPs utilisation")
STEP_SECONDS = TrainerMetric("supernode_train_step_seconds", "wall time of the last step")
STEP = TrainerMetric("supernode_train_step", "last completed step")
CHECKPOINT_TIME = TrainerMetric(
    "supernode_train_last_checkpoint_timestamp_seconds",
    "unix time the newest complete checkpoint was committed (checkpoint age = now - this)",
)
CHECKPOINT_STEP = TrainerMetric("supernode_train_last_checkpoint_step", "step of the newest complete checkpoint")
STEP_OVER_PLAN = TrainerMetric(
    "supernode_train_step_time_over_plan", "measured step time / the plan's estimate (1: as planned; the drift alarm)"
)
PHASE_SECONDS = TrainerMetric(
    "supernode_train_phase_seconds",
    "step time by phase: compute, exposed communication (comm: in flight with no compute beside it), data "
    "wait; checkpoint: how long the last save blocked training",
    "phase",
)
EXPERT_LOAD = TrainerMetric("supernode_train_expert_load_max_over_mean", "max/mean expert token share", "layer")
MEMORY_BYTES = TrainerMetric(
    "supernode_train_memory_bytes", "rank 0's memory by term, measured (trainer/memory.py)", "term"
)
PLAN_MEMORY_BYTES = TrainerMetric("supernode_train_plan_memory_bytes", "the plan's memory per rank by term", "term")
STALL_RESTARTS = TrainerMetric(
    "supernode_train_stall_restarts",
    "workers the launchers killed for making no progress within training.stallRestartS (OUT/stalls.jsonl)",
)
# Every gauge the trainer exports, and so every one the scrape turns into a CloudWatch metric.
TRAINER_METRICS = (
    LOSS,
    LR,
    GRAD_NORM,
    TOKENS_PER_S,
    FLOPS_PER_S_PER_RANK,
    MFU,
    STEP_SECONDS,
    STEP,
    PHASE_SECONDS,
    EXPERT_LOAD,
    CHECKPOINT_TIME,
    CHECKPOINT_STEP,
    STEP_OVER_PLAN,
    MEMORY_BYTES,
    PLAN_MEMORY_BYTES,
    STALL_RESTARTS,
)
# The DCGM exporter's fields that become metrics (its counters CSV, components/addons/dcgm-exporter.yaml,
# emits each under this name).
GPU_UTIL, GPU_MEMORY_USED = "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"
DCGM_METRICS = (
    GPU_UTIL,
    GPU_MEMORY_USED,
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_XID_ERRORS",
    # Node health (issue 26 item 4): memory and bus faults that precede a failed GPU; alarmed on
    # with the node agent's quarantine count (components/aws/monitoring.py).
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
)
ECC_DBE, ROW_REMAP_FAILURE, PCIE_REPLAYS = DCGM_METRICS[-3:]

# neuron-monitor's series on Trainium nodes (components/addons/neuron-monitor.yaml), named as
# /opt/aws/neuron/bin/neuron-monitor-prometheus.py (aws-neuronx-tools) registers them: process_neuroncore_counters,
# process_memory_used, process_execution_stats, process_neuron_hw_counters, process_memory_info; the same
# names AWS's Container Insights receiver reads (opentelemetry-collector-contrib,
# receiver/awscontainerinsightreceiver/internal/neuron/metric_name.go). The JSON fields behind them are in
# AWS's neuron-monitor user guide (tools/neuron-sys-tools/neuron-monitor-user-guide.rst).
NEURON_SCRAPE_JOB = "neuron-monitor"
NEURONCORE_UTIL = "neuroncore_utilization_ratio"  # gauge, 0-1, per NeuronCore in use (the percentage / 100)
# A gauge of the system metric groups, reported whether or not a Neuron application runs: the exporter's
# heartbeat (the per-application groups exist only while one runs).
NEURON_HOST_MEMORY_USED = "system_memory_used_bytes"
# Labelled series: the label becomes a dimension so an alarm can pick one value of it.
NEURON_MEMORY_USED = "neuron_runtime_memory_used_bytes"  # gauge per Neuron application (rank)
NEURON_ECC_EVENTS = "hardware_ecc_events_total"  # counter per device
NEURON_EXECUTION_ERRORS = "execution_errors_total"  # counter per Neuron application
NEURON_LABELS = {
    NEURON_MEMORY_USED: "memory_location",  # host | neuron_device
    NEURON_ECC_EVENTS: "event_type",  # mem_ecc_corrected | mem_ecc_uncorrected | sram_ecc_(un)corrected
    NEURON_EXECUTION_ERRORS: "error_type",  # generic | numerical | transient | model | runtime | hardware
}

# The dimensions of a series (the scrape relabels each pod's namespace and node to Namespace and
# Hostname); CloudWatch finds a metric only by exactly one of its dimension sets.
TRAINER_DIMENSIONS = ("ClusterName", "Namespace", "job")  # and a labelled gauge's label
DCGM_DIMENSIONS = (("ClusterName", "job"), ("ClusterName", "job", "Hostname"))  # cluster-wide, and per node


def trainer_dimensions(cluster_name: Any, namespace: str) -> dict[str, Any]:
    """The dimensions of a trainer series: its cluster, its namespace, the trainer's scrape job."""
    return dict(zip(TRAINER_DIMENSIONS, (cluster_name, namespace, TRAINER_SCRAPE_JOB)))


def dcgm_dimensions(cluster_name: Any) -> dict[str, Any]:
    """The cluster-wide dimensions of a DCGM field (the mean over the cluster's GPUs)."""
    return dict(zip(DCGM_DIMENSIONS[0], (cluster_name, DCGM_SCRAPE_JOB)))


def neuron_dimensions(cluster_name: Any, **label: str) -> dict[str, Any]:
    """The cluster-wide dimensions of a neuron-monitor series, and for a labelled one its label's value
    (`neuron_dimensions(c, error_type="hardware")`)."""
    return {"ClusterName": cluster_name, "job": NEURON_SCRAPE_JOB, **label}


# -- queues and job outcomes (issue 36, item 5) ----------------------------------------------------------
# Kueue's controller (components/addons/kueue.yaml, metrics on its https port, behind the API server's
# authentication and authorisation) and the training operator (components/addons/training-operator.yaml,
# plain http) are scraped as these jobs. Their series carry the queue (Kueue: `cluster_queue`, which is
# the team's ClusterQueue gpu-<acc>-<team>) or the namespace (the operator: `job_namespace`, the team's
# team-<name>) as a label, which becomes the metric's dimension. Neither carries the job's name: a job's
# own state is the job API's (`supernode job describe`), not a CloudWatch series per job.
KUEUE_SCRAPE_JOB = "kueue"
TRAINING_OPERATOR_SCRAPE_JOB = "training-operator"
# Kueue v0.11.9 (pkg/metrics/metrics.go). Its wait histogram, KUEUE_ADMISSION_WAIT (by cluster_queue),
# cannot go to CloudWatch as it is: the CloudWatch agent drops every histogram series (buckets, _sum
# and _count: it types a series by its family's TYPE, looked up by the name before any relabelling;
# amazon-cloudwatch-agent plugins/inputs/prometheus/metrics_type_handler.go, metrics_filter.go). The
# relay supernode.trainer.queue_wait reads it from Kueue and exports QUEUE_WAIT_P95 per queue, a
# gauge, which the agent scrapes as QUEUE_WAIT_SCRAPE_JOB.
KUEUE_ADMISSION_WAIT = "kueue_admission_wait_time_seconds"  # histogram, by cluster_queue
QUEUE_WAIT_SCRAPE_JOB = "supernode-queue-wait"
QUEUE_WAIT_P95 = "supernode_queue_wait_p95_seconds"  # gauge, by cluster_queue: the window's p95
QUEUE_ADMITTED_IN_WINDOW = "supernode_queue_admitted_in_window"  # gauge, by cluster_queue
QUEUE_OLDEST_PENDING = "supernode_queue_oldest_pending_seconds"  # gauge, by cluster_queue (visibility API)
KUEUE_PENDING = "kueue_pending_workloads"  # gauge, by cluster_queue and status (active | inadmissible)
KUEUE_ADMITTED = "kueue_admitted_workloads_total"  # counter, by cluster_queue
KUEUE_EVICTED = "kueue_evicted_workloads_total"  # counter, by cluster_queue and reason
KUEUE_PREEMPTED = "kueue_preempted_workloads_total"  # counter, by preempting_cluster_queue and reason
KUEUE_QUEUE_LABEL, KUEUE_PREEMPTING_LABEL = "cluster_queue", "preempting_cluster_queue"
KUEUE_PENDING_STATUSES = ("active", "inadmissible")
# The training operator v1.8.1 (pkg/common/metrics.go): counters by job_namespace and framework.
JOBS_CREATED, JOBS_SUCCEEDED, JOBS_FAILED, JOBS_RESTARTED = (
    "training_operator_jobs_created_total",
    "training_operator_jobs_successful_total",
    "training_operator_jobs_failed_total",
    "training_operator_jobs_restarted_total",
)
JOB_OUTCOMES = (JOBS_CREATED, JOBS_SUCCEEDED, JOBS_FAILED, JOBS_RESTARTED)
JOB_NAMESPACE_LABEL = "job_namespace"
QUEUE_DIMENSIONS = ("ClusterName", "job")  # and the series' queue or namespace label
# The agent's service account reads Kueue's /metrics with its own token: the ClusterRole that grants
# it (components/addons/kueue-observability.yaml), and where the token is in its pod.
KUEUE_METRICS_READER = "kueue-metrics-reader"
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class TeamQueue(NamedTuple):
    """Whose work waits where: a team (None: the stack's own training queue), its ClusterQueue (the
    `cluster_queue` of Kueue's series) and the namespace its jobs run in (the operator's `job_namespace`)."""

    team: str | None
    cluster_queue: str
    namespace: str


def team_queues(accelerators: Sequence[str], training_namespace: str, teams: Sequence[str] = ()) -> list[TeamQueue]:
    """The training queues the queue alarms watch: per pool (accelerator), the stack's own ClusterQueue
    gpu-<acc> fed from the training namespace, or, with teams, each team's gpu-<acc>-<team> fed from
    team-<team> (supernode.core.teams) and the first team's from the training namespace too. A queue may
    appear once per namespace it serves. Serving's queues are not here: no training job waits in them."""
    if not teams:
        return [TeamQueue(None, _object_name(f"gpu-{acc}"), training_namespace) for acc in accelerators]
    queues = [
        TeamQueue(team, _object_name(team_names.cluster_queue(team, acc)), team_names.namespace(team))
        for team in teams
        for acc in accelerators
    ]
    # With teams there is no gpu-<acc> training queue: the stack's own job queues in the first team's
    # (components/k8s/queues.py), so the training namespace's outcomes are that team's.
    return queues + [
        TeamQueue(teams[0], _object_name(team_names.cluster_queue(teams[0], acc)), training_namespace)
        for acc in accelerators
    ]


def _object_name(name: str) -> str:
    """A ClusterQueue's name as the stack writes it (components/k8s/common.py dns_name): gpu-H100 is
    gpu-h100 on the cluster."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63].rstrip("-")


def queue_dimensions(cluster_name: Any, job: str, **label: str) -> dict[str, Any]:
    """A queue series' dimensions: the cluster, the scrape job, the queue's or namespace's label."""
    return {"ClusterName": cluster_name, "job": job, **label}


# -- serving SLOs (issue 38, item 4) ----------------------------------------------------------------------
# vLLM's own series (the pinned vLLM's vllm/v1/metrics/loggers.py), each labelled model_name (the served
# model, the serving workload's app name) and engine (a data-parallel rank of the replica). Its latencies
# are histograms, which the CloudWatch agent drops (see KUEUE_ADMISSION_WAIT above; AWS's "Prometheus
# metric type conversion by the CloudWatch agent": histograms are not supported), so the relay
# supernode.trainer.serving_slo, a container beside the serving Prometheus (which scrapes every serving
# pod, components/k8s/serving.py), reads them with the request counter and the queue gauges from its
# federation endpoint and exports per model gauges over monitoring.servingSloWindowMinutes, which the
# agent scrapes as SERVING_SLO_SCRAPE_JOB.
VLLM_TTFT = "vllm:time_to_first_token_seconds"  # histogram
VLLM_ITL = "vllm:inter_token_latency_seconds"  # histogram, each gap between a request's output tokens
VLLM_REQUEST_SUCCESS = "vllm:request_success"  # counter (exposed as _total), by finished_reason
VLLM_REQUESTS_WAITING, VLLM_REQUESTS_RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"
VLLM_MODEL_LABEL, VLLM_FINISHED_REASON_LABEL, VLLM_ERROR_REASON = "model_name", "finished_reason", "error"
SERVING_SLO_SCRAPE_JOB = "supernode-serving-slo"
SERVING_TTFT_P99 = "supernode_serving_ttft_p99_seconds"  # gauge, by model_name: the window's p99
SERVING_ITL_P99 = "supernode_serving_itl_p99_seconds"  # gauge, by model_name: the window's p99
SERVING_REQUESTS_PER_S = "supernode_serving_requests_per_s"  # gauge: requests finished per second in the window
SERVING_ERROR_RATIO = "supernode_serving_error_ratio"  # gauge: errors / finished requests in the window
SERVING_REQUESTS_WAITING = "supernode_serving_requests_waiting"  # gauge: the queue depth now
SERVING_REQUESTS_RUNNING = "supernode_serving_requests_running"  # gauge: requests being decoded now
SERVING_SLO_METRICS = (
    SERVING_TTFT_P99,
    SERVING_ITL_P99,
    SERVING_REQUESTS_PER_S,
    SERVING_ERROR_RATIO,
    SERVING_REQUESTS_WAITING,
    SERVING_REQUESTS_RUNNING,
)
# One relay (beside the one serving Prometheus) sums every replica's series per model: no pod dimension.
SERVING_DIMENSIONS = ("ClusterName", "Namespace", "job", VLLM_MODEL_LABEL)
# Where the relay runs (its pod's namespace is the Namespace dimension): beside the serving Prometheus.
SERVING_MONITORING_NAMESPACE = "monitoring"
SERVING_SLO_ALARMS = {"ttft": "p99 time to first token", "itl": "p99 inter-token latency", "errors": "error rate"}


def serving_dimensions(cluster_name: Any, model: str) -> dict[str, Any]:
    """A served model's SLO series: its cluster (the stack), the relay's namespace and job, the model."""
    return dict(zip(SERVING_DIMENSIONS, (cluster_name, SERVING_MONITORING_NAMESPACE, SERVING_SLO_SCRAPE_JOB, model)))


def serving_slo_alarm(purpose: str, model: str) -> str:
    """The short name of the serving alarm of `purpose` (a SERVING_SLO_ALARMS key) for the served `model`."""
    assert purpose in SERVING_SLO_ALARMS, purpose
    return f"serving-{purpose}-{model}"


def _matching(names: Sequence[str], prefix: str) -> str:
    """An anchored regular expression for exactly `names`, the shared prefix written once."""
    if len(names) == 1:
        return f"^{names[0]}$"
    return f"^{prefix}({'|'.join(n.removeprefix(prefix) for n in names)})$"


def _declaration(job: str, dimensions: Sequence[Sequence[str]], selector: str) -> dict[str, Any]:
    return {
        "source_labels": ["job"],
        "label_matcher": f"^{job}$",
        "dimensions": [list(d) for d in dimensions],
        "metric_selectors": [selector],
    }


def _metric_declarations() -> list[dict[str, Any]]:
    """One declaration per trainer label set (none, phase, layer), one for the DCGM fields, one per
    neuron-monitor label set."""
    by_label: dict[str | None, list[str]] = {}
    for metric in TRAINER_METRICS:
        by_label.setdefault(metric.label, []).append(metric.name)
    trainer = [
        _declaration(
            TRAINER_SCRAPE_JOB, [TRAINER_DIMENSIONS + ((label,) if label else ())], _matching(names, "supernode_train_")
        )
        for label, names in by_label.items()
    ]
    # neuron-monitor's series, cluster-wide and per node like DCGM's; a labelled one with its label too.
    neuron = [
        _declaration(NEURON_SCRAPE_JOB, DCGM_DIMENSIONS, _matching((NEURONCORE_UTIL, NEURON_HOST_MEMORY_USED), "")),
        *(
            _declaration(NEURON_SCRAPE_JOB, [(*d, label) for d in DCGM_DIMENSIONS], _matching((metric,), ""))
            for metric, label in NEURON_LABELS.items()
        ),
    ]
    # Kueue's series by queue (pending ones by status too, so each status is one series; evictions by
    # reason too); preemptions by the preempting queue; the operator's outcomes by namespace.
    by_queue = [(*QUEUE_DIMENSIONS, KUEUE_QUEUE_LABEL)]
    queues = [
        _declaration(KUEUE_SCRAPE_JOB, by_queue, _matching((KUEUE_ADMITTED,), "")),
        _declaration(
            QUEUE_WAIT_SCRAPE_JOB,
            by_queue,
            _matching((QUEUE_WAIT_P95, QUEUE_ADMITTED_IN_WINDOW, QUEUE_OLDEST_PENDING), "supernode_queue_"),
        ),
        _declaration(KUEUE_SCRAPE_JOB, [(*by_queue[0], "status")], _matching((KUEUE_PENDING,), "")),
        _declaration(KUEUE_SCRAPE_JOB, [*by_queue, (*by_queue[0], "reason")], _matching((KUEUE_EVICTED,), "")),
        _declaration(
            KUEUE_SCRAPE_JOB,
            [(*QUEUE_DIMENSIONS, KUEUE_PREEMPTING_LABEL), (*QUEUE_DIMENSIONS, KUEUE_PREEMPTING_LABEL, "reason")],
            _matching((KUEUE_PREEMPTED,), ""),
        ),
        _declaration(
            TRAINING_OPERATOR_SCRAPE_JOB,
            [(*QUEUE_DIMENSIONS, JOB_NAMESPACE_LABEL)],
            _matching(JOB_OUTCOMES, "training_operator_jobs_"),
        ),
    ]
    serving = _declaration(
        SERVING_SLO_SCRAPE_JOB, [SERVING_DIMENSIONS], _matching(SERVING_SLO_METRICS, "supernode_serving_")
    )
    return [
        *trainer,
        _declaration(DCGM_SCRAPE_JOB, DCGM_DIMENSIONS, _matching(DCGM_METRICS, "DCGM_FI_DEV_")),
        *neuron,
        *queues,
        serving,
    ]


# The agent's embedded-metric declarations: which scraped series become CloudWatch metrics, with which
# dimensions.
METRIC_DECLARATIONS = _metric_declarations()

# The trainer profiles (torch.profiler/Kineto) one logged step in this many, plus a run's first and last:
# on every step it would cost the step (issue 39); a sample is enough for the exposed-communication share.
PROFILE_EVERY = 50


# -- alarms ----------------------------------------------------------------------------------------------
# Each alarm is "<stack prefix>-<short name>": monitoring creates it by its short name, the policy pack
# (monitoring-alarms) finds it by the same one.
NODE_NOT_READY_ALARM = "node-not-ready"
# Each accelerator alarm's purpose -> its short name on each vendor's stacks (InstanceType.vendor).
ACCELERATOR_ALARMS: dict[str, dict[str, str]] = {
    "utilisation-low": {"nvidia": "gpu-util-low", "neuron": "neuroncore-util-low"},
    "hardware-errors": {"nvidia": "gpu-xid-errors", "neuron": "neuron-hardware-errors"},
    "uncorrectable-ecc": {"nvidia": "gpu-ecc-uncorrectable", "neuron": "neuron-ecc-uncorrectable"},
    "exporter-absent": {"nvidia": "gpu-exporter-absent", "neuron": "neuron-exporter-absent"},
    "row-remap-failure": {"nvidia": "gpu-row-remap-failure"},
    "pcie-replays": {"nvidia": "gpu-pcie-replays"},
    "node-quarantined": {"nvidia": "node-quarantined"},
    "node-replaced": {"nvidia": "node-replaced"},
    "node-checks-not-run": {"nvidia": "node-checks-not-run"},
}
_NO_NODE_AGENT = (
    "no node health agent runs on Neuron node groups (it reads nvidia-smi, DCGM and XID lines; "
    "components/k8s/operations.py deploys it on NVIDIA nodes only)"
)
# Why a vendor has no alarm for a purpose (tests/components/test_trn2_monitoring.py holds every purpose of
# a GPU stack to a Trainium alarm or a reason here).
NO_EQUIVALENT: dict[tuple[str, str], str] = {
    ("row-remap-failure", "neuron"): "neuron-monitor reports no row remapping: its hardware counters are ECC "
    "events only (neuron_hw_counters), whose uncorrected ones neuron-ecc-uncorrectable alarms on",
    ("pcie-replays", "neuron"): "neuron-monitor reports no PCIe replay counter (neuron_hw_counters: ECC events only)",
    ("node-quarantined", "neuron"): _NO_NODE_AGENT,
    ("node-replaced", "neuron"): _NO_NODE_AGENT,
    ("node-checks-not-run", "neuron"): _NO_NODE_AGENT,
}


def accelerator_alarm(purpose: str, vendor: str) -> str:
    """The short name of the alarm of `purpose` on `vendor`'s stacks (KeyError: the vendor has none, see
    NO_EQUIVALENT)."""
    return ACCELERATOR_ALARMS[purpose][vendor]


# The queue alarms, one per training ClusterQueue and one per namespace whose jobs it queues (TeamQueue):
# the policy pack (monitoring-alarms) requires them for every such queue and namespace of the stack.
def queue_wait_alarm(cluster_queue: str) -> str:
    return f"queue-wait-{cluster_queue}"


def job_failure_alarm(namespace: str) -> str:
    return f"job-failure-rate-{namespace}"


SERVING_QUEUE_SUFFIX = "-serving"  # serving's ClusterQueues (components/k8s/queues.py): no training job waits there


def is_training_queue(cluster_queue: str) -> bool:
    return not cluster_queue.endswith(SERVING_QUEUE_SUFFIX)


# The deployment checklist's item 9 on an accelerator stack: the alarms it must have, by what they watch.
CHECKLIST_ALARMS = {"utilisation-low": "accelerator utilisation below the floor", "node-not-ready": "a node not ready"}


def checklist_alarm(purpose: str, vendor: str) -> str:
    return NODE_NOT_READY_ALARM if purpose == "node-not-ready" else accelerator_alarm(purpose, vendor)


# -- the trainer's log lines ------------------------------------------------------------------------------
class TrainerLine:
    """Phrases of the trainer's rank-0 lines that the log alarms match (components/aws/monitoring.py's
    LogPattern): the trainer builds those lines from these, so a reworded line moves its filter with it."""

    SKIPPED = "not finite, update skipped"  # "step N: loss nan, grad norm nan: not finite, update skipped (...)"
    CHECKPOINT = "; checkpoint "  # "step N: loss L; checkpoint written|started (async), ..."
    RESUMED = "resumed from checkpoint at step"  # "... at step N; training to step M ..."
    STARTED = "starting at step 0"
    # "metrics {JSON}": a step's record (loss, tokens_per_s, ...) and the newest checkpoint's step, once a
    # METRICS_LINE_EVERY_S at most: what `supernode job list | describe` reads from rank 0's log tail.
    METRICS = "metrics "


METRICS_LINE_EVERY_S = 60.0


# A run's metrics file: one JSON record per logged step (supernode.trainer.metrics writes it). Read here, in
# the core, so that what only reads it (the CLI's summary, the management page) imports no torch.
JSONL = "metrics.jsonl"


def read_records(path: str | Path) -> list[dict]:
    """Every parseable record of a metrics file. A torn line (a kill or a full disk mid-append) is
    skipped, not fatal: it must never block a resume or a summary."""
    recs = []
    p = Path(path)
    if not p.exists():
        return recs
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            recs.append(rec)
    return recs
