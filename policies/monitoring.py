"""Deployment checklist item 9: monitoring. The checklist's alarms exist by name (core.observability) and
notify SNS, log groups keep logs for a finite time, and the accelerators' exporter runs for the trainer."""

from __future__ import annotations

from pulumi_policy import EnforcementLevel
from pydantic import Field

from supernode.core.observability import CHECKLIST_ALARMS, checklist_alarm
from supernode.core.resource_types import (
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


def _alarm_named(alarms: list[Res], short: str) -> bool:
    """An alarm of this short name (the stack's alarms are "<prefix>-<short>", core.observability)."""
    names = [str(a.get("name") or a.name) for a in alarms]
    return any(n == short or n.endswith(f"-{short}") for n in names)


@POLICIES.stack("monitoring-alarms", 9, "Accelerator-utilisation and node-not-ready alarms exist and notify SNS.")
def _alarms(stack: Stack, _conf: None, report: Report) -> None:
    groups = stack.gpu_node_groups()
    if not groups:
        return
    alarms = stack.of(METRIC_ALARM)
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
