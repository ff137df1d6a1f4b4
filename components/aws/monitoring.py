"""Monitoring: Container Insights (the CloudWatch observability add-on), log groups, alarms on GPU
utilisation, node health, GPU XID errors, FSx free capacity, NCCL timeouts and OOM, an encrypted
SNS topic every alarm notifies, and a dashboard (issue 3, part 6).

The accelerator alarms follow the plan's vendor: DCGM's fields on NVIDIA stacks, neuron-monitor's series
on Trainium ones (issue 27), one alarm per purpose (the core's observability.ACCELERATOR_ALARMS); a purpose a vendor
cannot alarm on says why (NO_EQUIVALENT there), so a Trainium stack never silently lacks an alarm a GPU stack has.

Training health (issue 18): the trainer's Prometheus gauges (trainer/metrics.py) reach CloudWatch
through the CloudWatch agent's Prometheus scrape of the trainer pods (by annotation, see
components/k8s/operations.py), as embedded-metric-format metrics in PROMETHEUS_NAMESPACE; the names both
ends use are the observability contract (supernode/core/observability.py). We chose that
over Amazon Managed Prometheus + a PodMonitor because every alarm here already goes through
CloudWatch to one SNS topic: one alerting path, no workspace or alert manager to run. What the
trainer, the fabric check, the inventory and the restore drill say as log lines (non-finite steps,
checkpoints, starts, `fabric_regressed_node_count`, `inventory_drift_count`, `restore_drill`)
becomes metrics through log metric filters on the application log group.

Queues and job outcomes (issue 36, item 5), per team: for each training ClusterQueue (`queues`, the
core's observability.team_queues: the stack's own gpu-<acc> today, each team's gpu-<acc>-<team> once
the stack has teams) an alarm on its admission wait p95 (the relay supernode.trainer.queue_wait turns
Kueue's wait histogram, which the CloudWatch agent drops, into a gauge), and for each namespace those
queues serve an alarm on its jobs' failure rate (the training operator's failed / (failed + succeeded)
over a window, in metric math). The dashboard shows each queue's wait and pending workloads, Kueue's
evictions and preemptions, and each namespace's job outcomes.

Serving SLOs (issue 38, item 4), per served model: alarms on its p99 time to first token and p99
inter-token latency against the Plan's targets (inference.ttftTargetMs / itlTargetMs, as the inference
plan carries them; a target left unset has no alarm), and on its error rate above
monitoring.servingErrorRateMax. The p99s come from the relay supernode.trainer.serving_slo (vLLM's
latencies are histograms, which the CloudWatch agent drops), over monitoring.servingSloWindowMinutes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from supernode.core import observability as obs
from supernode.core.catalog import GIB
from supernode.core.config import MonitoringConfig
from supernode.core.plan import InferencePlan, Plan

from ..context import StackContext
from .cluster import Cluster
from .identity import irsa_trust_policy, managed_policy_arn

CONTAINER_INSIGHTS = "ContainerInsights"
# Container Insights writes to these groups; creating them first sets retention and KMS.
INSIGHTS_LOG_GROUPS = ("application", "dataplane", "host", "performance", "prometheus")
PERIOD_S = 60
# One GPU exporter: ours (components/addons/dcgm-exporter.yaml), scraped into the Prometheus namespace
# like the trainer. The add-on's own NVIDIA GPU collection is switched off, so no second exporter's
# series exist to be confused with ours.
AGENT_CONFIGURATION = {
    "agent": {
        "config": {
            "logs": {
                "metrics_collected": {
                    "kubernetes": {"enhanced_container_insights": True, "accelerated_compute_metrics": False}
                }
            }
        }
    }
}


# The utilisation alarms watch each node, not the cluster's mean (one idle node of 16 moves a mean by
# 6%, issue 41 item 4): a Metrics Insights query over the per-node series (the DCGM / neuron-monitor
# declarations' Hostname dimension set, obs.DCGM_DIMENSIONS), one time series per node. CloudWatch
# evaluates each series of such a multi-time-series alarm as its own contributor and names it (its
# Hostname) in the alarm's state and notification. Those alarms see at most the latest 3 hours (the
# config schema caps gpuUtilWindowMinutes at 180).
NODE_DIMENSION = "Hostname"
PER_NODE_NOTE = f"each node alarms on its own and is named by its {NODE_DIMENSION} contributor"
PCIE_REPLAYS_PER_MIN = 8  # `dcgmi health -c` warns above 8 PCIe replays a minute
EXPORTER_ABSENT_MINUTES = 5  # no series from the accelerator exporter for this long: the alarms above are blind
# The relay's p95 gauge at or above the threshold for this many minutes in a row: one relay read of a
# window edge does not page.
QUEUE_WAIT_PERIODS = 3
# A serving figure over its threshold for this many relay minutes in a row: one read at a window's edge
# (a burst of long prompts) does not page.
SERVING_SLO_PERIODS = 3


def _whose(q: obs.TeamQueue) -> str:
    return f"team {q.team}" if q.team else "the stack's training queue"


def _first_of_each(queues: Sequence[obs.TeamQueue], key: str) -> list[obs.TeamQueue]:
    first: dict[str, obs.TeamQueue] = {}
    for q in queues:
        first.setdefault(getattr(q, key), q)
    return list(first.values())


def _by_queue(queues: Sequence[obs.TeamQueue]) -> list[obs.TeamQueue]:
    """The first entry of each ClusterQueue (with teams, the first team's serves the training namespace too)."""
    return _first_of_each(queues, "cluster_queue")


def _by_namespace(queues: Sequence[obs.TeamQueue]) -> list[obs.TeamQueue]:
    """The first queue of each namespace (a namespace's jobs queue in one ClusterQueue per pool)."""
    return _first_of_each(queues, "namespace")


class LogPattern:
    """CloudWatch Logs filter patterns (any of the quoted terms) for failures worth a page."""

    NCCL_TIMEOUT = '?"Watchdog caught collective operation timeout" ?"NCCL timeout" ?"NCCL communicator was aborted"'
    OOM = '?"CUDA out of memory" ?"OutOfMemoryError" ?"Out of memory: Killed process"'
    GPU_XID = '?"NVRM: Xid" ?"NVRM: GPU has fallen off the bus"'
    # The trainer's own lines (rank 0), by the phrases it builds them from: a skipped non-finite step, a
    # checkpoint, a (re)start.
    NON_FINITE = f'"{obs.TrainerLine.SKIPPED}"'
    CHECKPOINT = f'"{obs.TrainerLine.CHECKPOINT}"'
    TRAINER_START = f'?"{obs.TrainerLine.RESUMED}" ?"{obs.TrainerLine.STARTED}"'
    # The JSON lines of the scheduled checks (trainer/node/fabric.py, the inventory, `supernode drill`).
    FABRIC_REGRESSED = "{ $.fabric_regressed_node_count = * }"
    INVENTORY_DRIFT = "{ $.inventory_drift_count = * }"
    RESTORE_DRILL_FAILED = '{ $.restore_drill = "failed" }'
    # The node health agent's round lines (trainer/node/agent.py).
    NODE_QUARANTINED = "{ $.node_quarantined = * }"
    NODE_REPLACED = "{ $.node_replaced = 1 }"
    CHECKS_NOT_RUN = "{ $.checks_not_run = * }"


@dataclass
class MonitoringArgs:
    ctx: StackContext
    monitoring: MonitoringConfig
    cluster: Cluster
    fsx_id: pulumi.Input[str]
    fsx_capacity_gib: int
    ops_kms_key_arn: pulumi.Input[str]
    node_groups: Sequence[pulumi.Resource]  # the add-on's agents run on them
    plan: Plan  # the throughput estimate, the checkpoint interval and step time the training alarms use
    training_namespace: str
    # The training queues and the namespaces they serve (obs.team_queues): a wait alarm for each queue,
    # a failure-rate alarm for each namespace.
    queues: Sequence[obs.TeamQueue] = ()
    serving_model: str | None = None  # the served model's name (model_name): its SLO alarms; None: no serving


class Monitoring(pulumi.ComponentResource):
    topic_arn: pulumi.Output[str]
    log_group_names: list[pulumi.Output[str]]
    alarm_names: list[pulumi.Output[str]]

    def __init__(self, name: str, args: MonitoringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:monitoring:Monitoring", name, None, opts)
        m, ctx = args.monitoring, args.ctx
        self.namespace, self.prefix = f"Supernode/{ctx.stack}", f"supernode-{ctx.stack}"

        self.topic = alarm_topic(name, args, self)
        self.topic_arn = self.topic.arn
        groups = insights_log_groups(name, args, self)
        self.log_group_names = [g.name for g in groups.values()]
        self.training_log_group_name = groups["application"].name  # where the trainer pods' stdout lands
        self.prometheus_log_group_arn = groups["prometheus"].arn  # where the Prometheus scrape writes (operations.py)
        self.agent_addon = observability_addon(name, args, groups, self)
        log_metric_filters(name, self.namespace, groups, args.plan.hardware.vendor_row.node_agent, self)

        floor = round(m.throughput_floor_fraction * planned_tokens_per_s(args.plan), 1)
        checkpoint_window_s = checkpoint_window(args.plan)
        self.alarms = [
            *self._cluster_alarms(name, args),
            *self._training_alarms(name, args, floor, checkpoint_window_s),
            *self._operations_alarms(name),
            *self._accelerator_alarms(name, args.plan.hardware.vendor, args.cluster.name, m),
            *self._queue_alarms(name, args),
            *self._serving_alarms(name, args),
        ]
        self.alarm_names = [a.name for a in self.alarms]
        self.dashboard = stack_dashboard(name, args, self.namespace, floor, checkpoint_window_s, self)
        self.register_outputs({"topic_arn": self.topic_arn, "alarm_names": self.alarm_names})

    def _cluster_alarms(self, name: str, args: MonitoringArgs) -> list[aws.cloudwatch.MetricAlarm]:
        """A node not ready, NCCL timeouts and out-of-memory errors in the training logs, FSx nearly full."""
        m = args.monitoring
        return [
            self._alarm(
                name,
                obs.NODE_NOT_READY_ALARM,
                "a node is not ready",
                namespace=CONTAINER_INSIGHTS,
                metric_name="cluster_failed_node_count",
                dimensions={"ClusterName": args.cluster.name},
                statistic="Maximum",
                threshold=0,
                comparison="GreaterThanThreshold",
                periods=5,
            ),
            self._any(name, "nccl-timeouts", "NCCL collective timeouts in training logs", "NcclTimeouts"),
            self._any(name, "out-of-memory", "out-of-memory errors in training logs", "OutOfMemory"),
            self._alarm(
                name,
                "fsx-free-capacity-low",
                f"FSx free capacity below {m.fsx_free_capacity_floor_percent}%",
                namespace="AWS/FSx",
                metric_name="FreeDataStorageCapacity",
                dimensions={"FileSystemId": args.fsx_id},
                statistic="Minimum",
                threshold=fsx_free_floor_bytes(args.fsx_capacity_gib, m.fsx_free_capacity_floor_percent),
                comparison="LessThanThreshold",
                periods=5,
            ),
        ]

    def _training_alarms(
        self, name: str, args: MonitoringArgs, floor: float, checkpoint_window_s: int
    ) -> list[aws.cloudwatch.MetricAlarm]:
        """Training health: the trainer's gauges (progress, throughput, the plan's step time) and log lines."""
        m, plan = args.monitoring, args.plan
        train = obs.trainer_dimensions(args.cluster.name, args.training_namespace)
        return [
            # The step gauge unchanged over the window: max - min of one window-long period is 0.
            self._alarm(
                name,
                "training-step-stalled",
                f"no training step for {m.step_stall_minutes} min "
                "(the trainer is up but its step gauge has not advanced)",
                threshold=0,
                comparison="LessThanOrEqualToThreshold",
                periods=1,
                metric_queries=progress_queries(train, m.step_stall_minutes * 60),
            ),
            self._alarm(
                name,
                "training-throughput-low",
                f"tokens/s below {m.throughput_floor_fraction:g} x the "
                f"plan's estimate ({floor:,.0f} tokens/s) for {m.step_stall_minutes} min",
                namespace=obs.PROMETHEUS_NAMESPACE,
                metric_name=obs.TOKENS_PER_S.name,
                dimensions=train,
                statistic="Average",
                threshold=floor,
                comparison="LessThanThreshold",
                periods=m.step_stall_minutes,
            ),
            # |measured / planned - 1| over the window: a slower run (a bad node, a slow link) and a
            # faster one (the plan's efficiencies are off: calibrate) both mean the plan is not the run.
            self._alarm(
                name,
                "training-plan-drift",
                f"measured step time off the plan's estimate ({plan.step.step_s:.3g} s) by more than "
                f"{m.plan_drift_fraction:.0%} for {m.step_stall_minutes} min",
                threshold=m.plan_drift_fraction,
                comparison="GreaterThanThreshold",
                periods=m.step_stall_minutes,
                metric_queries=plan_drift_queries(train),
            ),
            self._any(
                name,
                "training-loss-not-finite",
                "a training step had a non-finite loss or gradient norm (its update skipped)",
                "NonFiniteSteps",
            ),
            # Steps advanced but no checkpoint line for 2 x the checkpoint interval (at the planned step time).
            self._alarm(
                name,
                "checkpoint-stale",
                f"no checkpoint for {checkpoint_window_s // 60} min (2 x "
                f"training.checkpointInterval = {plan.training.checkpoint_interval} steps at the "
                "planned step time) while steps advance",
                threshold=0,
                comparison="GreaterThanThreshold",
                periods=1,
                metric_queries=checkpoint_stale_queries(train, checkpoint_window_s, self.namespace),
            ),
            self._alarm(
                name,
                "training-restarts",
                f"the trainer started more than {m.restart_alarm_count} times in an hour",
                namespace=self.namespace,
                metric_name="TrainerStarts",
                statistic="Sum",
                threshold=m.restart_alarm_count,
                comparison="GreaterThanThreshold",
                periods=1,
                period=3600,
            ),
        ]

    def _queue_alarms(self, name: str, args: MonitoringArgs) -> list[aws.cloudwatch.MetricAlarm]:
        """Per training ClusterQueue its wait p95, per namespace it serves its jobs' failure rate."""
        m, cluster = args.monitoring, args.cluster.name
        wait_s, window_s = m.queue_wait_p95_minutes * 60, m.job_failure_window_hours * 3600
        alarms = [
            self._alarm(
                name,
                obs.queue_wait_alarm(q.cluster_queue),
                f"{_whose(q)}: work waits {m.queue_wait_p95_minutes} min or more in ClusterQueue "
                f"{q.cluster_queue}: the admission wait p95 of the last {m.queue_wait_p95_minutes} min's "
                "admissions, or the oldest workload still pending at training priority or above",
                threshold=wait_s,
                comparison="GreaterThanOrEqualToThreshold",
                periods=QUEUE_WAIT_PERIODS,
                metric_queries=queue_wait_queries(
                    obs.queue_dimensions(cluster, obs.QUEUE_WAIT_SCRAPE_JOB, cluster_queue=q.cluster_queue)
                ),
            )
            for q in _by_queue(args.queues)
        ]
        for q in _by_namespace(args.queues):
            alarms.append(
                self._alarm(
                    name,
                    obs.job_failure_alarm(q.namespace),
                    f"{_whose(q)}: more than {m.job_failure_rate_max:.0%} of the jobs that finished in namespace "
                    f"{q.namespace} within {m.job_failure_window_hours} h failed (training operator counts)",
                    threshold=m.job_failure_rate_max,
                    comparison="GreaterThanThreshold",
                    periods=1,
                    metric_queries=failure_rate_queries(
                        obs.queue_dimensions(cluster, obs.TRAINING_OPERATOR_SCRAPE_JOB, job_namespace=q.namespace),
                        window_s,
                    ),
                )
            )
        return alarms

    def _serving_alarms(self, name: str, args: MonitoringArgs) -> list[aws.cloudwatch.MetricAlarm]:
        """The served model's p99 TTFT and ITL against the Plan's targets, and its error rate (the one
        relay sums every replica's series, so each figure is the model's)."""
        ip, model, m = args.plan.inference, args.serving_model, args.monitoring
        if ip is None or model is None:
            return []
        dims = obs.serving_dimensions(args.cluster.name, model)
        window = f"over the last {m.serving_slo_window_minutes} min"
        latencies = (
            ("ttft", obs.SERVING_TTFT_P99, ip.ttft_target_ms, ip.ttft_ms, "ttftTargetMs"),
            ("itl", obs.SERVING_ITL_P99, ip.itl_target_ms, ip.itl_ms, "itlTargetMs"),
        )
        alarms = [
            self._alarm(
                name,
                obs.serving_slo_alarm(purpose, model),
                f"{model}: the {obs.SERVING_SLO_ALARMS[purpose]} {window} is above the {target_ms:g} ms target "
                f"(inference.{key}; the plan estimates {estimate_ms:.1f} ms)",
                namespace=obs.PROMETHEUS_NAMESPACE,
                metric_name=metric,
                statistic="Maximum",
                dimensions=dims,
                threshold=target_ms / 1e3,  # the relay's gauges are in seconds
                comparison="GreaterThanThreshold",
                periods=SERVING_SLO_PERIODS,
            )
            for purpose, metric, target_ms, estimate_ms, key in latencies
            if target_ms is not None
        ]
        alarms.append(
            self._alarm(
                name,
                obs.serving_slo_alarm("errors", model),
                f"{model}: more than {m.serving_error_rate_max:.1%} of the requests finished {window} failed in "
                "the server (monitoring.servingErrorRateMax; vLLM's finished_reason error)",
                namespace=obs.PROMETHEUS_NAMESPACE,
                metric_name=obs.SERVING_ERROR_RATIO,
                statistic="Maximum",
                dimensions=dims,
                threshold=m.serving_error_rate_max,
                comparison="GreaterThanThreshold",
                periods=SERVING_SLO_PERIODS,
            )
        )
        return alarms

    def _operations_alarms(self, name: str) -> list[aws.cloudwatch.MetricAlarm]:
        """The scheduled operations' findings (components/k8s/operations.py)."""
        return [
            self._any(
                name,
                "fabric-regressed",
                "the scheduled fabric check names node(s) whose pairs regressed from the baseline",
                "FabricRegressedNodes",
                "Maximum",
            ),
            self._any(
                name,
                "inventory-drift",
                "a GPU node's driver, firmware, library or host settings differ from the inventory baseline",
                "InventoryDrift",
                "Maximum",
            ),
            self._any(name, "restore-drill-failed", "the checkpoint restore drill failed", "RestoreDrillFailures"),
        ]

    def _accelerator_alarms(
        self, name: str, vendor: str, cluster_name: pulumi.Input[str], m: MonitoringConfig
    ) -> list[aws.cloudwatch.MetricAlarm]:
        """The alarms on the accelerators and their exporter, by the vendor's metric names (obs.ACCELERATOR_ALARMS)."""
        window = m.gpu_util_window_minutes * 60 // PERIOD_S
        if vendor == "neuron":
            return self._neuron_alarms(name, cluster_name, m, window)
        gpus = obs.dcgm_dimensions(cluster_name)
        return [
            *self._gpu_alarms(name, gpus, m, window),
            *self._node_health_alarms(name),
            *self._gpu_counter_alarms(name, gpus),
        ]

    def _gpu_alarms(
        self, name: str, gpus: Mapping, m: MonitoringConfig, window: int
    ) -> list[aws.cloudwatch.MetricAlarm]:
        """DCGM's utilisation per node, the driver's XID lines, and the DCGM exporter's own absence."""
        return [
            self._alarm(
                name,
                obs.accelerator_alarm("utilisation-low", "nvidia"),
                f"a node's GPU utilisation below {m.gpu_util_floor_percent}% for "
                f"{m.gpu_util_window_minutes} min (DCGM exporter, mean over the node's GPUs; {PER_NODE_NOTE})",
                threshold=m.gpu_util_floor_percent,
                comparison="LessThanThreshold",
                periods=window,
                missing="notBreaching",
                metric_queries=[per_node_query("utilisation", obs.GPU_UTIL, gpus, "GPU utilisation")],
            ),
            self._any(
                name,
                obs.accelerator_alarm("hardware-errors", "nvidia"),
                "NVIDIA XID errors in node kernel logs",
                "GpuXidErrors",
            ),
            self._exporter_absent(
                name, obs.accelerator_alarm("exporter-absent", "nvidia"), "DCGM exporter", obs.GPU_UTIL, gpus
            ),
        ]

    def _node_health_alarms(self, name: str) -> list[aws.cloudwatch.MetricAlarm]:
        """What the node health agent did or could not do (trainer/node/agent.py; issue 26 item 4)."""
        return [
            self._any(
                name,
                obs.accelerator_alarm("node-quarantined", "nvidia"),
                "the node health agent quarantined a GPU node (tainted supernode.io/unhealthy)",
                "NodesQuarantined",
                "Maximum",
            ),
            self._any(
                name,
                obs.accelerator_alarm("node-replaced", "nvidia"),
                "the node health agent terminated a faulty GPU instance for its Auto Scaling group to replace",
                "NodesReplaced",
            ),
            self._any(
                name,
                obs.accelerator_alarm("node-checks-not-run", "nvidia"),
                "a GPU node's health checks did not all run (the agent's checks_not_run; its NodeChecksNotRun "
                "Event names the checks and why): the node is not known healthy",
                "NodeChecksNotRun",
                "Maximum",
            ),
        ]

    def _gpu_counter_alarms(self, name: str, gpus: Mapping) -> list[aws.cloudwatch.MetricAlarm]:
        """DCGM's fault counters: uncorrectable ECC errors, failed row remaps, PCIe replays."""
        return [
            *(
                self._alarm(
                    name,
                    short,
                    description,
                    namespace=obs.PROMETHEUS_NAMESPACE,
                    metric_name=metric,
                    dimensions=gpus,
                    statistic="Maximum",
                    threshold=0,
                    comparison="GreaterThanThreshold",
                    periods=1,
                )
                for short, metric, description in (
                    (
                        obs.accelerator_alarm("uncorrectable-ecc", "nvidia"),
                        obs.ECC_DBE,
                        "a GPU counted uncorrectable (double-bit) ECC errors",
                    ),
                    (
                        obs.accelerator_alarm("row-remap-failure", "nvidia"),
                        obs.ROW_REMAP_FAILURE,
                        "a GPU failed to remap a memory row",
                    ),
                )
            ),
            # A cumulative counter: alarm on its growth, at dcgmi health's PCIe warning level.
            self._alarm(
                name,
                obs.accelerator_alarm("pcie-replays", "nvidia"),
                f"a GPU's PCIe link replayed more than {PCIE_REPLAYS_PER_MIN} transfers a minute",
                threshold=PCIE_REPLAYS_PER_MIN,
                comparison="GreaterThanThreshold",
                periods=1,
                metric_queries=pcie_replay_queries(gpus),
            ),
        ]

    def _neuron_alarms(
        self, name: str, cluster_name: pulumi.Input[str], m: MonitoringConfig, window: int
    ) -> list[aws.cloudwatch.MetricAlarm]:
        """Trainium's alarms on neuron-monitor's series. Its counters reach CloudWatch as the increase
        since the previous scrape (the CloudWatch agent's Prometheus counter conversion), so a Sum above 0
        is a new event."""

        def ecc(qid: str, event_type: str) -> aws.cloudwatch.MetricAlarmMetricQueryArgs:
            return _query(
                qid,
                period=PERIOD_S,
                namespace=obs.PROMETHEUS_NAMESPACE,
                metric_name=obs.NEURON_ECC_EVENTS,
                dimensions=obs.neuron_dimensions(cluster_name, event_type=event_type),
                stat="Sum",
            )

        return [
            # neuroncore_utilization_ratio is a 0-1 ratio: the floor in percent / 100. It exists only for
            # NeuronCores a Neuron application runs on, so no training means no data, not an alarm.
            self._alarm(
                name,
                obs.accelerator_alarm("utilisation-low", "neuron"),
                f"a node's NeuronCore utilisation below {m.gpu_util_floor_percent}% for "
                f"{m.gpu_util_window_minutes} min (neuron-monitor, mean over the node's NeuronCores in use; "
                f"{PER_NODE_NOTE})",
                threshold=m.gpu_util_floor_percent / 100,
                comparison="LessThanThreshold",
                periods=window,
                missing="notBreaching",
                metric_queries=[
                    per_node_query(
                        "utilisation",
                        obs.NEURONCORE_UTIL,
                        obs.neuron_dimensions(cluster_name),
                        "NeuronCore utilisation",
                    )
                ],
            ),
            # error_type "hardware": "hardware errors such as uncorrectable ECC issues" (neuron-monitor
            # user guide, execution_stats), what XID lines are to the NVIDIA driver.
            self._alarm(
                name,
                obs.accelerator_alarm("hardware-errors", "neuron"),
                "a Neuron application's executions failed with hardware errors (neuron-monitor execution_stats)",
                namespace=obs.PROMETHEUS_NAMESPACE,
                metric_name=obs.NEURON_EXECUTION_ERRORS,
                dimensions=obs.neuron_dimensions(cluster_name, error_type="hardware"),
                statistic="Sum",
                threshold=0,
                comparison="GreaterThanThreshold",
                periods=1,
            ),
            self._alarm(
                name,
                obs.accelerator_alarm("uncorrectable-ecc", "neuron"),
                "a Neuron device counted uncorrected ECC events in its HBM or SRAM",
                threshold=0,
                comparison="GreaterThanThreshold",
                periods=1,
                metric_queries=[
                    ecc("hbm", "mem_ecc_uncorrected"),
                    ecc("sram", "sram_ecc_uncorrected"),
                    aws.cloudwatch.MetricAlarmMetricQueryArgs(
                        id="uncorrected",
                        return_data=True,
                        label="uncorrected ECC events",
                        expression="FILL(hbm, 0) + FILL(sram, 0)",
                    ),
                ],
            ),
            self._exporter_absent(
                name,
                obs.accelerator_alarm("exporter-absent", "neuron"),
                "neuron-monitor",
                obs.NEURON_HOST_MEMORY_USED,
                obs.neuron_dimensions(cluster_name),
            ),
        ]

    def _exporter_absent(
        self, name: str, short: str, exporter: str, heartbeat: str, dimensions: Mapping
    ) -> aws.cloudwatch.MetricAlarm:
        """No datapoint of a series the exporter always reports for EXPORTER_ABSENT_MINUTES: the
        exporter (or its scrape) is down and every alarm on its series is blind."""
        return self._alarm(
            name,
            short,
            f"no {exporter} series for {EXPORTER_ABSENT_MINUTES} min: the accelerator alarms see nothing "
            "(also while the accelerator node groups are at 0, e.g. after a Capacity Block ends)",
            namespace=obs.PROMETHEUS_NAMESPACE,
            metric_name=heartbeat,
            dimensions=dimensions,
            statistic="SampleCount",
            threshold=1,
            comparison="LessThanThreshold",
            periods=EXPORTER_ABSENT_MINUTES,
            missing="breaching",
        )

    def _any(
        self, name: str, short: str, description: str, metric_name: str, statistic: str = "Sum"
    ) -> aws.cloudwatch.MetricAlarm:
        """An alarm on any occurrence: one of this stack's metrics above 0 in a period (the Sum of a
        log-metric-filter count, or the Maximum of a gauge the operations jobs publish)."""
        return self._alarm(
            name,
            short,
            description,
            namespace=self.namespace,
            metric_name=metric_name,
            statistic=statistic,
            threshold=0,
            comparison="GreaterThanThreshold",
            periods=1,
        )

    def _alarm(
        self,
        name: str,
        short: str,
        description: str,
        *,
        threshold: float,
        comparison: str,
        periods: int,
        namespace: str | None = None,
        metric_name: str | None = None,
        statistic: str | None = None,
        dimensions: Mapping | None = None,
        period: int = PERIOD_S,
        missing: str = "notBreaching",
        metric_queries: list | None = None,
    ) -> aws.cloudwatch.MetricAlarm:
        """One alarm on one metric, or on a metric-math expression (`metric_queries`)."""
        single = (
            {}
            if metric_queries
            else dict(
                namespace=namespace,
                metric_name=metric_name,
                dimensions=dict(dimensions) if dimensions else None,
                statistic=statistic,
                period=period,
            )
        )
        return aws.cloudwatch.MetricAlarm(
            f"{name}-{short}",
            name=f"{self.prefix}-{short}",
            alarm_description=description,
            evaluation_periods=periods,
            datapoints_to_alarm=periods,
            threshold=threshold,
            comparison_operator=comparison,
            treat_missing_data=missing,
            metric_queries=metric_queries,
            alarm_actions=[self.topic.arn],
            ok_actions=[self.topic.arn],
            opts=pulumi.ResourceOptions(parent=self),
            **single,
        )


def alarm_topic(name: str, args: MonitoringArgs, parent: pulumi.Resource) -> aws.sns.Topic:
    """The encrypted SNS topic every alarm notifies, with the configured email subscribed."""
    child = pulumi.ResourceOptions(parent=parent)
    topic = aws.sns.Topic(
        name,
        name=f"supernode-{args.ctx.stack}-alarms",
        kms_master_key_id=args.ops_kms_key_arn,
        tags=args.ctx.tagged(),
        opts=child,
    )
    aws.sns.TopicSubscription(
        f"{name}-email", topic=topic.arn, protocol="email", endpoint=args.monitoring.notification_email, opts=child
    )
    return topic


def insights_log_groups(name: str, args: MonitoringArgs, parent: pulumi.Resource) -> dict[str, aws.cloudwatch.LogGroup]:
    """Container Insights' log groups (INSIGHTS_LOG_GROUPS), by kind."""
    return {
        kind: aws.cloudwatch.LogGroup(
            f"{name}-{kind}",
            name=obs.insights_log_group(args.cluster.name, kind),
            retention_in_days=args.monitoring.log_retention_days,
            kms_key_id=args.ops_kms_key_arn,
            tags=args.ctx.tagged(),
            opts=pulumi.ResourceOptions(parent=parent),
        )
        for kind in INSIGHTS_LOG_GROUPS
    }


def observability_addon(
    name: str, args: MonitoringArgs, groups: Mapping[str, aws.cloudwatch.LogGroup], parent: pulumi.Resource
) -> aws.eks.Addon:
    """The CloudWatch observability add-on and its agent's IRSA role, once its log groups exist and there
    are nodes for its agents."""
    child = pulumi.ResourceOptions(parent=parent)
    agent_role = aws.iam.Role(
        f"{name}-cloudwatch-agent",
        tags=args.ctx.tagged(),
        opts=child,
        assume_role_policy=irsa_trust_policy(
            args.cluster.oidc_provider_arn, args.cluster.oidc_issuer_url, *obs.CLOUDWATCH_AGENT
        ),
    )
    attach = aws.iam.RolePolicyAttachment(
        f"{name}-cloudwatch-agent",
        role=agent_role.name,
        policy_arn=managed_policy_arn("CloudWatchAgentServerPolicy"),
        opts=child,
    )
    return args.cluster.addon(
        "amazon-cloudwatch-observability",
        service_account_role_arn=agent_role.arn,
        parent=parent,
        depends_on=[attach, *groups.values(), *args.node_groups],
        configuration_values=json.dumps(AGENT_CONFIGURATION, sort_keys=True),
    )


def log_metric_filters(
    name: str,
    namespace: str,
    groups: Mapping[str, aws.cloudwatch.LogGroup],
    node_agent: bool,
    parent: pulumi.Resource,
) -> None:
    """The log lines that become this stack's metrics (in `namespace`), for the alarms and the dashboard.
    `node_agent`: the vendor's nodes run the node health agent (the vendor row)."""
    # Each filter: (log group, pattern, metric value: 1 per line or a JSON field of the line).
    filters = {
        "NcclTimeouts": (groups["application"], LogPattern.NCCL_TIMEOUT, "1"),
        "OutOfMemory": (groups["application"], LogPattern.OOM, "1"),
        "NonFiniteSteps": (groups["application"], LogPattern.NON_FINITE, "1"),
        "CheckpointsSaved": (groups["application"], LogPattern.CHECKPOINT, "1"),
        "TrainerStarts": (groups["application"], LogPattern.TRAINER_START, "1"),
        "FabricRegressedNodes": (
            groups["application"],
            LogPattern.FABRIC_REGRESSED,
            "$.fabric_regressed_node_count",
        ),
        "InventoryDrift": (groups["application"], LogPattern.INVENTORY_DRIFT, "$.inventory_drift_count"),
        "RestoreDrillFailures": (groups["application"], LogPattern.RESTORE_DRILL_FAILED, "1"),
    }
    if node_agent:
        # The NVIDIA driver's kernel lines (Neuron's hardware errors are a neuron-monitor metric) and
        # the node health agent's, which runs where the vendor row says (obs.NO_EQUIVALENT).
        filters["GpuXidErrors"] = (groups["host"], LogPattern.GPU_XID, "1")
        # Summed over the agents' lines of a period: quarantined node-rounds (0 when all pass).
        filters["NodesQuarantined"] = (groups["application"], LogPattern.NODE_QUARANTINED, "$.node_quarantined")
        filters["NodesReplaced"] = (groups["application"], LogPattern.NODE_REPLACED, "1")
        # The checks each agent's round could not run (a tool missing, refused or timed out).
        filters["NodeChecksNotRun"] = (groups["application"], LogPattern.CHECKS_NOT_RUN, "$.checks_not_run")
    for metric, (group, pattern, value) in filters.items():
        aws.cloudwatch.LogMetricFilter(
            f"{name}-{metric}",
            log_group_name=group.name,
            pattern=pattern,
            opts=pulumi.ResourceOptions(parent=parent),
            # JSON-valued metrics have no default: a line without the field is no datapoint.
            metric_transformation=aws.cloudwatch.LogMetricFilterMetricTransformationArgs(
                name=metric, namespace=namespace, value=value, default_value="0" if value == "1" else None
            ),
        )


def stack_dashboard(
    name: str,
    args: MonitoringArgs,
    namespace: str,
    throughput_floor: float,
    checkpoint_window_s: int,
    parent: pulumi.Resource,
) -> aws.cloudwatch.Dashboard:
    """The stack's dashboard (`dashboard`), once the FSx file system's id is known."""
    return aws.cloudwatch.Dashboard(
        name,
        dashboard_name=f"supernode-{args.ctx.stack}",
        opts=pulumi.ResourceOptions(parent=parent),
        dashboard_body=pulumi.Output.all(args.fsx_id).apply(
            lambda a: json.dumps(
                dashboard(
                    args.ctx.region,
                    args.cluster.name,
                    namespace,
                    a[0],
                    args.monitoring,
                    args.training_namespace,
                    throughput_floor,
                    checkpoint_window_s,
                    args.plan.hardware.vendor,
                    args.queues,
                    _served(args),
                )
            )
        ),
    )


def per_node_select(metric_name: str, dimensions: Mapping[str, str], statistic: str = "AVG") -> str:
    """A Metrics Insights query: `metric_name`'s series with `dimensions` and the node dimension, one
    time series per node (GROUP BY), the lowest first, so that a multi-time-series alarm evaluates
    every node on its own."""
    keys = ", ".join(sorted([*dimensions, NODE_DIMENSION]))
    where = " AND ".join(f"{k} = '{v}'" for k, v in sorted(dimensions.items()))
    return (
        f'SELECT {statistic}({metric_name}) FROM SCHEMA("{obs.PROMETHEUS_NAMESPACE}", {keys}) WHERE {where} '
        f"GROUP BY {NODE_DIMENSION} ORDER BY {statistic}() ASC"
    )


def per_node_query(
    qid: str, metric_name: str, dimensions: Mapping, label: str
) -> aws.cloudwatch.MetricAlarmMetricQueryArgs:
    """The alarm's one query: `per_node_select` over the cluster-wide `dimensions` (their values may be
    Outputs, the cluster's name), at PERIOD_S."""
    return aws.cloudwatch.MetricAlarmMetricQueryArgs(
        id=qid,
        expression=pulumi.Output.from_input(dict(dimensions)).apply(lambda d: per_node_select(metric_name, d)),
        label=f"{label} per node",
        period=PERIOD_S,
        return_data=True,
    )


def planned_tokens_per_s(plan: Plan) -> float:
    """The plan's throughput estimate: one global batch of sequences per planned step time."""
    return plan.training.global_batch * plan.model.seq_len / plan.step.step_s


def checkpoint_window(plan: Plan) -> int:
    """2 x the checkpoint interval at the planned step time, in whole minutes (CloudWatch periods)."""
    seconds = 2 * plan.training.checkpoint_interval * plan.step.step_s
    return max(PERIOD_S, -(-int(seconds) // PERIOD_S) * PERIOD_S)


def _query(
    qid: str, *, period: int, namespace: str, metric_name: str, stat: str, dimensions: Mapping | None = None
) -> aws.cloudwatch.MetricAlarmMetricQueryArgs:
    return aws.cloudwatch.MetricAlarmMetricQueryArgs(
        id=qid,
        return_data=False,
        metric=aws.cloudwatch.MetricAlarmMetricQueryMetricArgs(
            namespace=namespace,
            metric_name=metric_name,
            dimensions=dict(dimensions) if dimensions else None,
            period=period,
            stat=stat,
        ),
    )


def progress_queries(
    dimensions: Mapping, period_s: int, expression_id: str = "advanced", return_data: bool = True
) -> list:
    """Steps advanced within one `period_s` window: max - min of the trainer's step gauge."""
    step = dict(namespace=obs.PROMETHEUS_NAMESPACE, metric_name=obs.STEP.name, dimensions=dimensions, period=period_s)
    return [
        _query("last", stat="Maximum", **step),
        _query("first", stat="Minimum", **step),
        aws.cloudwatch.MetricAlarmMetricQueryArgs(
            id=expression_id, expression="last - first", label="steps advanced", return_data=return_data
        ),
    ]


def plan_drift_queries(dimensions: Mapping) -> list:
    """|measured / planned - 1|: the trainer's step-time-over-plan gauge's distance from 1."""
    return [
        _query(
            "ratio",
            stat="Average",
            period=PERIOD_S,
            namespace=obs.PROMETHEUS_NAMESPACE,
            metric_name=obs.STEP_OVER_PLAN.name,
            dimensions=dimensions,
        ),
        aws.cloudwatch.MetricAlarmMetricQueryArgs(
            id="drift", expression="ABS(ratio - 1)", label="step time drift from the plan", return_data=True
        ),
    ]


def checkpoint_stale_queries(dimensions: Mapping, window_s: int, namespace: str) -> list:
    """1 when steps advanced within one `window_s` window but no checkpoint line (in `namespace`) did."""
    return [
        *progress_queries(dimensions, window_s, expression_id="progress", return_data=False),
        _query("saved", period=window_s, namespace=namespace, metric_name="CheckpointsSaved", stat="Sum"),
        aws.cloudwatch.MetricAlarmMetricQueryArgs(
            id="stale",
            return_data=True,
            label="steps advanced without a checkpoint",
            expression="IF(progress > 0 AND FILL(saved, 0) == 0, 1, 0)",
        ),
    ]


def queue_wait_queries(dimensions: Mapping) -> list:
    """The longer of the relay's two waits: the window's admission p95 (which a queue that admits nothing
    never raises) and the oldest pending workload's age at training priority or above."""
    gauge = dict(period=PERIOD_S, namespace=obs.PROMETHEUS_NAMESPACE, stat="Maximum", dimensions=dimensions)
    return [
        _query("p95", metric_name=obs.QUEUE_WAIT_P95, **gauge),
        _query("oldest", metric_name=obs.QUEUE_OLDEST_PENDING, **gauge),
        aws.cloudwatch.MetricAlarmMetricQueryArgs(
            id="wait",
            return_data=True,
            label="queue wait (s)",
            expression="MAX([FILL(p95, 0), FILL(oldest, 0)])",
        ),
    ]


def failure_rate_queries(dimensions: Mapping, window_s: int) -> list:
    """failed / (failed + succeeded) of the jobs that finished within one `window_s` window (the training
    operator's counters, whose per-scrape growth the agent sends), 0 when none finished."""
    counts = dict(period=window_s, namespace=obs.PROMETHEUS_NAMESPACE, stat="Sum", dimensions=dimensions)
    return [
        _query("failed", metric_name=obs.JOBS_FAILED, **counts),
        _query("succeeded", metric_name=obs.JOBS_SUCCEEDED, **counts),
        aws.cloudwatch.MetricAlarmMetricQueryArgs(
            id="failure_rate",
            return_data=True,
            label="failed / finished jobs",
            expression="IF(FILL(failed, 0) + FILL(succeeded, 0) > 0, "
            "FILL(failed, 0) / (FILL(failed, 0) + FILL(succeeded, 0)), 0)",
        ),
    ]


def pcie_replay_queries(gpus: Mapping) -> list:
    """PCIe replays a minute: the growth rate of DCGM's cumulative replay counter."""
    return [
        _query(
            "replays",
            period=PERIOD_S,
            namespace=obs.PROMETHEUS_NAMESPACE,
            metric_name=obs.PCIE_REPLAYS,
            dimensions=gpus,
            stat="Maximum",
        ),
        aws.cloudwatch.MetricAlarmMetricQueryArgs(
            id="per_minute",
            return_data=True,
            label="PCIe replays a minute",
            expression="RATE(replays) * 60",
        ),
    ]


def fsx_free_floor_bytes(capacity_gib: int, floor_percent: float) -> float:
    return capacity_gib * GIB * floor_percent / 100


def dashboard(
    region: str,
    cluster_name: str,
    namespace: str,
    fsx_id: str,
    m: MonitoringConfig,
    training_namespace: str,
    throughput_floor: float,
    checkpoint_window_s: int,
    vendor: str,
    queues: Sequence[obs.TeamQueue] = (),
    served: tuple[str, InferencePlan] | None = None,
) -> dict:
    """The dashboard's body: the accelerators, failures, training, the queues, the served model (`served`:
    its name and inference plan), then operations and FSx."""
    if vendor == "neuron":
        accelerators, hardware_errors = _neuron_widgets(region, cluster_name, m), []
    else:
        accelerators, hardware_errors = _gpu_widgets(region, cluster_name, m), [[namespace, "GpuXidErrors"]]
    trainer = obs.trainer_dimensions(cluster_name, training_namespace)
    return {
        "widgets": [
            *accelerators,
            *_failure_widgets(region, cluster_name, namespace, hardware_errors),
            *_training_widgets(region, trainer, throughput_floor, checkpoint_window_s),
            *_queue_widgets(region, cluster_name, m, queues),
            *(_serving_widgets(region, cluster_name, m, *served) if served else ()),
            *_operations_widgets(region, namespace, fsx_id),
        ]
    }


def _served(args: MonitoringArgs) -> tuple[str, InferencePlan] | None:
    """The served model's name and inference plan, where the stack serves one."""
    ip, model = args.plan.inference, args.serving_model
    return None if ip is None or model is None else (model, ip)


def _serving_widgets(region: str, cluster_name: str, m: MonitoringConfig, model: str, ip: InferencePlan) -> list[dict]:
    """The SLO relay's gauges of the served model: p99 TTFT and ITL with their alarms' targets (the plan's
    estimate in the title), requests and errors, and the queue of requests now."""
    dims = obs.serving_dimensions(cluster_name, model)

    def latency(what: str, metric: str, target_ms: float | None, estimate_ms: float) -> dict:
        title = f"{model}: p99 {what} (s; plan estimates {estimate_ms / 1e3:.3g})"
        target = None if target_ms is None else target_ms / 1e3
        return _widget(region, title, [_series(metric, dims) + [{"stat": "Maximum"}]], target, f"{what} alarm")

    return [
        latency("TTFT", obs.SERVING_TTFT_P99, ip.ttft_target_ms, ip.ttft_ms),
        latency("ITL", obs.SERVING_ITL_P99, ip.itl_target_ms, ip.itl_ms),
        _widget(
            region,
            f"{model}: error ratio (requests finished in error)",
            [_series(obs.SERVING_ERROR_RATIO, dims) + [{"stat": "Maximum"}]],
            m.serving_error_rate_max,
            "errors alarm",
        ),
        _widget(
            region,
            f"{model}: requests/s finished, requests waiting and running",
            [
                _series(metric, dims) + [{"stat": "Maximum", "label": label}]
                for metric, label in (
                    (obs.SERVING_REQUESTS_PER_S, "finished/s"),
                    (obs.SERVING_REQUESTS_WAITING, "waiting"),
                    (obs.SERVING_REQUESTS_RUNNING, "running"),
                )
            ],
        ),
    ]


def _widget(region: str, title: str, metrics: list, annotation: float | None = None, label: str = "floor") -> dict:
    """One time-series widget, half the dashboard's width, with a horizontal line at `annotation`."""
    props = {"title": title, "region": region, "metrics": metrics, "period": PERIOD_S, "view": "timeSeries"}
    if annotation is not None:
        props["annotations"] = {"horizontal": [{"label": label, "value": annotation}]}
    return {"type": "metric", "width": 12, "height": 6, "properties": props}


def _series(metric_name: str, dimensions: Mapping) -> list:
    """A series of the Prometheus namespace: its name, then each dimension's name and value."""
    return [obs.PROMETHEUS_NAMESPACE, metric_name, *(x for kv in dimensions.items() for x in kv)]


def _by_label(metric: obs.TrainerMetric, dimensions: Mapping) -> list:
    """Every series of a labelled gauge (one per phase, one per MoE layer)."""
    name, label = metric.name, metric.label
    keys = ",".join([obs.PROMETHEUS_NAMESPACE, *dimensions, label])
    where = " ".join(f'{k}="{v}"' for k, v in dimensions.items())
    return [
        {
            "expression": f"SEARCH('{{{keys}}} MetricName=\"{name}\" {where}', 'Average', {PERIOD_S})",
            "id": f"{label}s",
            "label": label,
        }
    ]


def _neuron_widgets(region: str, cluster_name: str, m: MonitoringConfig) -> list[dict]:
    """neuron-monitor's NeuronCore utilisation, device memory, hardware errors and ECC events."""
    return [
        _widget(
            region,
            "NeuronCore utilisation (0-1)",
            [_series(obs.NEURONCORE_UTIL, obs.neuron_dimensions(cluster_name))],
            m.gpu_util_floor_percent / 100,
        ),
        _widget(
            region,
            "Neuron device memory used (bytes)",
            [_series(obs.NEURON_MEMORY_USED, obs.neuron_dimensions(cluster_name, memory_location="neuron_device"))],
        ),
        _widget(
            region,
            "Neuron hardware errors and uncorrected ECC events",
            [
                _series(obs.NEURON_EXECUTION_ERRORS, obs.neuron_dimensions(cluster_name, error_type="hardware")),
                *(
                    _series(obs.NEURON_ECC_EVENTS, obs.neuron_dimensions(cluster_name, event_type=event))
                    for event in ("mem_ecc_uncorrected", "sram_ecc_uncorrected")
                ),
            ],
        ),
    ]


def _gpu_widgets(region: str, cluster_name: str, m: MonitoringConfig) -> list[dict]:
    """DCGM's GPU utilisation and memory."""
    gpus = obs.dcgm_dimensions(cluster_name)
    return [
        _widget(region, "GPU utilisation (%)", [_series(obs.GPU_UTIL, gpus)], m.gpu_util_floor_percent),
        _widget(region, "GPU memory used (MiB)", [_series(obs.GPU_MEMORY_USED, gpus)]),
    ]


def _failure_widgets(region: str, cluster_name: str, namespace: str, hardware_errors: list) -> list[dict]:
    """Failed nodes, and the training failures the logs show (with the vendor's `hardware_errors`)."""
    return [
        _widget(
            region, "Failed nodes", [[CONTAINER_INSIGHTS, "cluster_failed_node_count", "ClusterName", cluster_name]]
        ),
        _widget(
            region,
            "Training failures",
            [
                [namespace, "NcclTimeouts"],
                [namespace, "OutOfMemory"],
                *hardware_errors,
                [namespace, "NonFiniteSteps"],
                [namespace, "TrainerStarts"],
            ],
        ),
    ]


def _training_widgets(region: str, trainer: Mapping, throughput_floor: float, checkpoint_window_s: int) -> list[dict]:
    """The trainer's gauges (by its `trainer` dimensions): loss, throughput, MFU, steps, phases, experts,
    and the checkpoint's age."""
    return [
        _widget(region, "Training loss", [_series(obs.LOSS.name, trainer)]),
        _widget(region, "Tokens/s", [_series(obs.TOKENS_PER_S.name, trainer)], throughput_floor),
        _widget(region, "MFU", [_series(obs.MFU.name, trainer)]),
        _widget(region, "Step", [_series(obs.STEP.name, trainer)]),
        _widget(region, "Step time by phase (s)", _by_label(obs.PHASE_SECONDS, trainer)),
        _widget(region, "Expert load (max/mean per MoE layer; 1 = balanced)", _by_label(obs.EXPERT_LOAD, trainer)),
        # The trainer's commit-time gauge; EPOCH gives each datapoint's own time, so age = EPOCH(ts) - ts.
        _widget(
            region,
            "Checkpoint age (s)",
            [
                _series(obs.CHECKPOINT_TIME.name, trainer) + [{"id": "ts", "stat": "Maximum", "visible": False}],
                {"expression": "EPOCH(ts) - ts", "id": "age", "label": "since the last commit"},
            ],
            checkpoint_window_s,
            "checkpoint-stale alarm",
        ),
    ]


def _queue_widgets(region: str, cluster_name: str, m: MonitoringConfig, queues: Sequence[obs.TeamQueue]) -> list[dict]:
    """Per training ClusterQueue its wait p95 and pending workloads, Kueue's evictions and preemptions by
    queue, and per namespace its jobs' outcomes (counts a minute: the counters' growth, summed)."""
    if not queues:
        return []
    total = {"stat": "Sum"}

    def kueue(metric: str, **label: str) -> list:
        return _series(metric, obs.queue_dimensions(cluster_name, obs.KUEUE_SCRAPE_JOB, **label))

    return [
        _widget(
            region,
            "Queue wait (s): admission p95, oldest pending",
            [
                _series(metric, obs.queue_dimensions(cluster_name, obs.QUEUE_WAIT_SCRAPE_JOB, cluster_queue=q))
                + [{"stat": "Maximum", "label": f"{q} {what}"}]
                for q in (q.cluster_queue for q in _by_queue(queues))
                for metric, what in ((obs.QUEUE_WAIT_P95, "p95"), (obs.QUEUE_OLDEST_PENDING, "oldest pending"))
            ],
            m.queue_wait_p95_minutes * 60,
            "queue-wait alarm",
        ),
        _widget(
            region,
            "Pending workloads",
            [
                kueue(obs.KUEUE_PENDING, cluster_queue=q.cluster_queue, status=status)
                + [{"stat": "Maximum", "label": f"{q.cluster_queue} {status}"}]
                for q in _by_queue(queues)
                for status in obs.KUEUE_PENDING_STATUSES
            ],
        ),
        _widget(
            region,
            "Evictions and preemptions",
            [
                *(kueue(obs.KUEUE_EVICTED, cluster_queue=q.cluster_queue) + [total] for q in _by_queue(queues)),
                *(
                    kueue(obs.KUEUE_PREEMPTED, preempting_cluster_queue=q.cluster_queue) + [total]
                    for q in _by_queue(queues)
                ),
            ],
        ),
        _widget(
            region,
            "Job outcomes",
            [
                _series(
                    metric,
                    obs.queue_dimensions(cluster_name, obs.TRAINING_OPERATOR_SCRAPE_JOB, job_namespace=q.namespace),
                )
                + [{**total, "label": f"{q.namespace} {metric.removeprefix('training_operator_jobs_')}"}]
                for q in _by_namespace(queues)
                for metric in obs.JOB_OUTCOMES
            ],
        ),
    ]


def _operations_widgets(region: str, namespace: str, fsx_id: str) -> list[dict]:
    """The scheduled checks' findings, and FSx's free capacity and throughput."""
    return [
        _widget(
            region,
            "Fabric, inventory and restore drill",
            [
                [namespace, "FabricRegressedNodes"],
                [namespace, "InventoryDrift"],
                [namespace, "RestoreDrillFailures"],
            ],
        ),
        _widget(region, "FSx free capacity (bytes)", [["AWS/FSx", "FreeDataStorageCapacity", "FileSystemId", fsx_id]]),
        _widget(
            region,
            "FSx throughput (bytes)",
            [
                ["AWS/FSx", "DataWriteBytes", "FileSystemId", fsx_id],
                ["AWS/FSx", "DataReadBytes", "FileSystemId", fsx_id],
            ],
        ),
    ]
