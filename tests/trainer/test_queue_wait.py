"""The queue-wait relay (supernode.trainer.queue_wait): Kueue's wait histogram -> a p95 gauge per
ClusterQueue over the trailing window, from Kueue's real exposition format."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest

from supernode.trainer import queue_wait as qw

# Kueue v0.11.9's buckets (pkg/metrics: 1, then 2.5 doubling, 14 in all) and +Inf.
BOUNDS = [1.0] + [2.5 * 2**i for i in range(13)] + [math.inf]


def exposition(waits: dict[str, list[float]], pending: dict[str, tuple[int, int]], leader: bool | None = True) -> str:
    """Kueue's /metrics: the histogram's buckets, _sum and _count per cluster_queue (the leader's
    scheduler records them), the pending gauge per cluster_queue and status (every replica), and
    controller-runtime's leader election status (None: left out)."""
    lines = [
        "# HELP kueue_admission_wait_time_seconds The time between a workload was created or requeued until admission",
        "# TYPE kueue_admission_wait_time_seconds histogram",
    ]
    for cq, xs in waits.items():
        for le in BOUNDS:
            label = "+Inf" if le == math.inf else repr(le).removesuffix(".0")
            lines.append(
                f'kueue_admission_wait_time_seconds_bucket{{cluster_queue="{cq}",le="{label}"}} '
                f"{sum(1 for x in xs if x <= le)}"
            )
        lines.append(f'kueue_admission_wait_time_seconds_sum{{cluster_queue="{cq}"}} {sum(xs)}')
        lines.append(f'kueue_admission_wait_time_seconds_count{{cluster_queue="{cq}"}} {len(xs)}')
    lines += ["# HELP kueue_pending_workloads The number of pending workloads", "# TYPE kueue_pending_workloads gauge"]
    for cq, (active, inadmissible) in pending.items():
        lines.append(f'kueue_pending_workloads{{cluster_queue="{cq}",status="active"}} {active}')
        lines.append(f'kueue_pending_workloads{{cluster_queue="{cq}",status="inadmissible"}} {inadmissible}')
    lines += ["# HELP go_goroutines Number of goroutines", "# TYPE go_goroutines gauge", "go_goroutines 212"]
    if leader is not None:
        lines += [
            "# HELP leader_election_master_status Gauge of if the reporting system is master of the relevant lease",
            "# TYPE leader_election_master_status gauge",
            f'leader_election_master_status{{name="c1f6bfd2.kueue.x-k8s.io"}} {int(leader)}',
        ]
    return "\n".join(lines) + "\n"


def test_quantile_interpolates_inside_the_rank_bucket_as_histogram_quantile():
    # 10 waits in (1, 2.5], 10 in (2.5, 5]: rank 19 of 20 is 9/10 into the second bucket
    assert qw.quantile(0.95, {1.0: 0, 2.5: 10, 5.0: 20, math.inf: 20}) == pytest.approx(2.5 + 2.5 * 0.9)
    # in the first bucket: from 0
    assert qw.quantile(0.5, {1.0: 4, 2.5: 4, math.inf: 4}) == pytest.approx(0.5)
    # beyond the last finite bound: that bound (Prometheus does the same)
    assert qw.quantile(0.95, {1.0: 0, 2.5: 0, math.inf: 3}) == 2.5
    assert qw.quantile(0.95, {1.0: 0, math.inf: 0}) is None  # nothing observed


def test_parse_reads_the_leader_and_skips_the_other_replica():
    snap = qw.parse(exposition({"gpu-h100": [0.5, 3.0, 700.0]}, {"gpu-h100": (2, 1)}), at=10.0)
    assert snap is not None and snap.pending == {"gpu-h100": 3}  # active + inadmissible
    buckets = snap.buckets["gpu-h100"]
    assert buckets[1.0] == 1 and buckets[5.0] == 2 and buckets[math.inf] == 3 and len(buckets) == len(BOUNDS)
    # the replica that is not the leader: pending workloads (it keeps the queues too) but no waits
    assert qw.parse(exposition({}, {"gpu-h100": (2, 1)}, leader=False), at=10.0) is None
    # the leader before its first admission: no waits yet, still the leader's snapshot
    assert qw.parse(exposition({}, {"gpu-h100": (2, 1)}), at=10.0) is not None
    # without the leader gauge, the histogram tells the leader
    assert qw.parse(exposition({}, {"gpu-h100": (2, 1)}, leader=None), at=10.0) is None
    assert qw.parse(exposition({"gpu-h100": [1.0]}, {}, leader=None), at=10.0) is not None


def test_the_other_replicas_scrapes_do_not_reset_the_p95():
    """The Service answers from either replica: one that is not the leader must not read as 'no waits'."""
    window = qw.Window(3600.0)
    slow = {"gpu-h100": [600.0] * 10}
    for t, waits, leader in [(0, {}, True), (30, {}, False), (60, slow, True), (90, {}, False)]:
        snap = qw.parse(exposition(waits, {"gpu-h100": (1, 0)}, leader=leader), t)
        if snap is not None:
            window.add(snap)
    p95, admitted = window.queues()["gpu-h100"]
    assert admitted == 10 and p95 > 300


def test_the_p95_is_of_the_window_not_of_all_time():
    """300 quick admissions an hour ago, then 10 that waited ~10 min: the window's p95 is the slow ones';
    the histogram's all-time p95 would say a few seconds."""
    window = qw.Window(3600.0)
    quick = [0.5] * 300
    slow = quick + [600.0] * 10
    window.add(qw.parse(exposition({"gpu-h100": quick}, {"gpu-h100": (0, 0)}), at=0.0))
    window.add(qw.parse(exposition({"gpu-h100": slow}, {"gpu-h100": (0, 0)}), at=3600.0))
    p95, admitted = window.queues()["gpu-h100"]
    assert admitted == 10 and 320.0 <= p95 <= 640.0  # inside the bucket that holds 600 s
    all_time = qw.quantile(0.95, qw.parse(exposition({"gpu-h100": slow}, {}), at=0).buckets["gpu-h100"])
    assert all_time < 10 < p95


def test_a_queue_that_admits_nothing_shows_its_oldest_pending_work_above_the_floor():
    """Kueue records a wait only at admission: the window's p95 of a stuck queue is 0, its oldest pending
    workload (the visibility API's summary) is what shows it; experiments below the floor wait by design."""
    window = qw.Window(600.0)
    for t in range(0, 601, 60):
        window.add(qw.parse(exposition({"gpu-h100": [1.0]}, {"gpu-h100": (2, 0)}), t))
    assert window.queues()["gpu-h100"] == (0.0, 0)
    now = 1_750_000_000.0
    summary = {  # PendingWorkloadsSummary as Kueue v0.11's visibility API returns it
        "kind": "PendingWorkloadsSummary",
        "apiVersion": "visibility.kueue.x-k8s.io/v1beta1",
        "metadata": {"creationTimestamp": None},
        "items": [
            {
                "metadata": {"name": "pytorchjob-a", "namespace": "team-research", "creationTimestamp": stamp},
                "priority": priority,
                "localQueueName": "gpu-h100",
                "positionInClusterQueue": i,
                "positionInLocalQueue": i,
            }
            for i, (stamp, priority) in enumerate(
                [
                    (datetime.fromtimestamp(now - 7200, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), 500),
                    (datetime.fromtimestamp(now - 86400, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), 100),
                ]
            )
        ],
    }
    assert qw.oldest_pending_s(summary, now, min_priority=500) == pytest.approx(7200)  # not the fabric check's day
    assert qw.oldest_pending_s(summary, now, min_priority=0) == pytest.approx(86400)
    assert qw.oldest_pending_s({"items": []}, now, min_priority=0) == 0.0


def test_a_new_leaders_counters_start_the_window_again():
    window = qw.Window(3600.0)
    window.add(qw.parse(exposition({"gpu-h100": [600.0] * 50}, {"gpu-h100": (0, 0)}), 0))
    window.add(qw.parse(exposition({"gpu-h100": [2.0]}, {"gpu-h100": (0, 0)}), 60))  # counters went down
    assert len(window.snapshots) == 1
    window.add(qw.parse(exposition({"gpu-h100": [2.0, 2.0]}, {"gpu-h100": (0, 0)}), 120))
    p95, admitted = window.queues()["gpu-h100"]
    assert admitted == 1 and p95 <= 2.5  # the old leader's slow waits are gone, not negative counts
