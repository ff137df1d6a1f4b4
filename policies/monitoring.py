"""Deployment checklist item 9: monitoring. The checklist's alarms exist by name (core.observability) and
notify SNS, every training queue has its wait alarm and every namespace it serves its job-failure-rate
alarm, log groups keep logs for a finite time, and the accelerators' exporter runs for the trainer."""

from __future__ import annotations

from pulumi_policy import EnforcementLevel
from pydantic import Field

from supernode.core.observability import (
    CHECKLIST_ALARMS,
    SERVING_SLO_ALARMS,
    checklist_alarm,
    is_training_queue,
    job_failure_alarm,
    queue_wait_alarm,
)
from supernode.core.resource_types import (
    CLUSTER_QUEUE,
    LOCAL_QUEUE,
    LOG_GROUP,
    METRIC_ALARM,
)
from supernode.core.vendors import VENDORS

from .base import Registry, Report
from .settings import PolicySettings
from .view import (
    Res,
    Stack,
    daemon_sets_running,
    hardware,
    items,
)

POLICIES = Registry()

ADVISORY = EnforcementLevel.ADVISORY


class LogRetention(PolicySettings):
    min_retention_days: int = Field(default=7, ge=1, description="shortest CloudWatch log retention allowed")


# -- 9. monitoring --------------------------------------------------------------------------------


def _alarm_names(alarms: list[Res]) -> list[str]:
    """The alarms' names: "<prefix>-<short>" on the stack's alarms (core.observability)."""
    return [str(a.get("name") or a.name) for a in alarms]


def _alarm_named(alarms: list[Res], short: str) -> bool:
    """An alarm of this short name."""
    return any(n == short or n.endswith(f"-{short}") for n in _alarm_names(alarms))


def _queue_alarms(stack: Stack, alarms: list[Res], report: Report) -> None:
    """Every training ClusterQueue (serving's excepted) has its wait alarm, and every namespace with a
    LocalQueue into one its job-failure-rate alarm: a team whose work waits or fails unseen."""
    training = {
        str(q.get("metadata", "name")): q
        for q in stack.of(CLUSTER_QUEUE)
        if is_training_queue(str(q.get("metadata", "name")))
    }
    for name, q in training.items():
        short = queue_wait_alarm(name)
        if not _alarm_named(alarms, short):
            report(
                q,
                f"no CloudWatch alarm watches how long work waits in ClusterQueue {name!r}: none is named "
                f"{short!r}. Fix: add the aws.cloudwatch.MetricAlarm '<prefix>-{short}' on the queue's wait p95 "
                f"(supernode:monitoring.queueWaitP95Minutes; the team's queue in observability.team_queues).",
            )
    served: dict[str, Res] = {}
    for lq in stack.of(LOCAL_QUEUE):
        if lq.get("spec", "clusterQueue") in training:
            served.setdefault(str(lq.get("metadata", "namespace")), lq)
    for namespace, lq in sorted(served.items()):
        short = job_failure_alarm(namespace)
        if not _alarm_named(alarms, short):
            report(
                lq,
                f"no CloudWatch alarm watches the failure rate of the jobs queued from namespace {namespace!r}: "
                f"none is named {short!r}. Fix: add the aws.cloudwatch.MetricAlarm '<prefix>-{short}' "
                f"(supernode:monitoring.jobFailureRateMax; the team's namespace in observability.team_queues).",
            )


def _serving_alarms(stack: Stack, alarms: list[Res], report: Report) -> None:
    """A stack that serves has its model's error-rate alarm, and a latency alarm for each target it sets:
    a target nothing watches is a promise nobody checks."""
    plan = stack.plan()
    ip = plan.inference if plan else None
    if ip is None:
        return
    required = [("errors", "")] + [  # errors always; a latency where its target is set
        (purpose, f" (target {target:g} ms, inference.{key})")
        for purpose, target, key in (
            ("ttft", ip.ttft_target_ms, "ttftTargetMs"),
            ("itl", ip.itl_target_ms, "itlTargetMs"),
        )
        if target is not None
    ]
    names = _alarm_names(alarms)
    for purpose, target_text in required:
        prefix = f"serving-{purpose}-"  # core.observability.serving_slo_alarm(purpose, <model>)
        if not any(n.startswith(prefix) or f"-{prefix}" in n for n in names):
            report(
                stack.plan_config_map(),
                f"the stack serves a model but no CloudWatch alarm watches its "
                f"{SERVING_SLO_ALARMS[purpose]}{target_text}: none is named '<prefix>-{prefix}<model>'. "
                "Fix: keep the serving SLO alarms "
                "(components/aws/monitoring.py, fed by supernode.trainer.serving_slo).",
            )


@POLICIES.stack(
    "monitoring-alarms",
    9,
    "Accelerator-utilisation, node-not-ready, each training queue's wait and job-failure-rate alarms and the "
    "served model's latency and error alarms exist and notify SNS.",
)
def _alarms(stack: Stack, _conf: None, report: Report) -> None:
    alarms = stack.of(METRIC_ALARM)
    _queue_alarms(stack, alarms, report)
    _serving_alarms(stack, alarms, report)
    groups = stack.gpu_node_groups()
    if not groups:
        return
    vendor = hardware(stack).vendor
    for purpose, what in CHECKLIST_ALARMS.items():
        short = checklist_alarm(purpose, vendor)
        if not _alarm_named(alarms, short):
            report(
                groups[0],
                f"no CloudWatch alarm watches {what} for {', '.join(g.label for g in groups)}: none is named "
                f"{short!r}. Fix: add the aws.cloudwatch.MetricAlarm '<prefix>-{short}' with the SNS topic as "
                f"its action (supernode:monitoring).",
            )
    for a in alarms:
        actions = [str(x) for x in items(a.get("alarmActions"))]
        if not any(x.startswith("arn:aws") and ":sns:" in x for x in actions):
            report(
                a,
                f"{a.label} notifies nobody: alarmActions {actions} has no SNS topic. Fix: set alarmActions to "
                f"the stack's SNS topic ARN.",
            )


@POLICIES.resource(
    "monitoring-log-retention", 9, "Log groups have a finite retention.", (LOG_GROUP,), settings=LogRetention
)
def _log_retention(log_group: Res, conf: LogRetention, report: Report) -> None:
    days = log_group.get("retentionInDays")
    if not days or days < conf.min_retention_days:
        report(
            log_group,
            f"{log_group.label} keeps logs {'forever' if not days else f'{days:g} days'}; retention must be "
            f"at least {conf.min_retention_days} days and finite. Fix: set retentionInDays "
            f"(supernode:monitoring.logRetentionDays).",
        )


@POLICIES.stack(
    "monitoring-dcgm", 9, "The accelerators' exporter (DCGM, or neuron-monitor) is deployed for the trainer."
)
def _dcgm(stack: Stack, _conf: None, report: Report) -> None:
    """The trainer's accelerators have their metrics exporter: DCGM on GPUs, neuron-monitor on Trainium."""
    jobs = stack.trainer_jobs()
    row = VENDORS[hardware(stack).vendor]
    image, what = row.exporter, row.exporter_noun
    if jobs and not daemon_sets_running(stack, image):
        for job in jobs:
            report(
                job,
                f"{job.label} runs without accelerator metrics: no {what} DaemonSet ({image}) is deployed, so "
                f"the utilisation alarm has no data. Fix: deploy {image} on the accelerator nodes "
                f"(components/addons/).",
            )
