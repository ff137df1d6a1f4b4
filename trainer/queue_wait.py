"""Queue wait p95 per ClusterQueue, as a gauge the CloudWatch agent can carry (issue 36, item 5).

    python -m supernode.trainer.queue_wait watch --source https://kueue-...:8443/metrics --window-s 3600

Kueue measures each workload's wait until admission in a histogram (kueue_admission_wait_time_seconds,
by cluster_queue). The CloudWatch agent's Prometheus scrape drops every histogram series, so the
histogram never reaches CloudWatch by itself. This relay reads Kueue's metrics endpoint once a
`--interval-s`, keeps the snapshots of the trailing `--window-s`, and exports per ClusterQueue:

- supernode_queue_wait_p95_seconds: the 95th percentile of the waits of the workloads admitted within
  the window (from the buckets' growth, interpolated inside a bucket as Prometheus' histogram_quantile
  does); 0 when nothing was admitted;
- supernode_queue_admitted_in_window: how many workloads were admitted within the window;
- supernode_queue_oldest_pending_seconds: the age of the oldest workload still pending at or above
  `--min-priority` (Kueue's visibility API, clusterqueues/<cq>/pendingworkloads), 0 when none is. Kueue
  records a wait only at admission, so a queue that admits nothing would otherwise look idle; and work
  below the floor (experiments, the scheduled fabric check) waits for free nodes by design, so it is not
  counted here (the histogram has no priority: its p95 counts such work when it is admitted).

Only the leader of Kueue's two replicas observes admissions (its scheduler records the waits), while
both report pending workloads (every replica keeps the queues); a scrape that reached the other replica
(the Service picks either) is skipped: controller-runtime's leader_election_master_status says which
answered (without it, a scrape with no wait histogram is taken for the other replica's). A counter that
went down (a new leader) starts the window again.

Exit codes: 0 (stopped), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import ssl
import sys
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from prometheus_client import Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from supernode.core.observability import (
    KUEUE_ADMISSION_WAIT,
    KUEUE_PENDING,
    KUEUE_QUEUE_LABEL,
    QUEUE_ADMITTED_IN_WINDOW,
    QUEUE_OLDEST_PENDING,
    QUEUE_WAIT_P95,
    SERVICE_ACCOUNT_TOKEN,
)

QUANTILE = 0.95
SERVICE_ACCOUNT_CA = str(Path(SERVICE_ACCOUNT_TOKEN).with_name("ca.crt"))
PENDING_PATH = "/apis/visibility.kueue.x-k8s.io/v1beta1/clusterqueues/{}/pendingworkloads"
Buckets = dict[float, float]  # upper bound (le) -> cumulative count


@dataclass(frozen=True)
class Snapshot:
    """One scrape of the leader: per ClusterQueue its wait buckets and its pending workloads."""

    at: float
    buckets: Mapping[str, Buckets]
    pending: Mapping[str, float]


LEADER = "leader_election_master_status"  # controller-runtime's: 1 on the replica that holds the lease


def parse(text: str, at: float) -> Snapshot | None:
    """A scrape's queue series; None when it is not the leader's."""
    buckets: dict[str, Buckets] = {}
    pending: dict[str, float] = {}
    leader: bool | None = None
    for family in text_string_to_metric_families(text):
        if family.name == LEADER:
            leader = any(s.value == 1 for s in family.samples)
        elif family.name == KUEUE_ADMISSION_WAIT:
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    buckets.setdefault(s.labels[KUEUE_QUEUE_LABEL], {})[float(s.labels["le"])] = s.value
        elif family.name == KUEUE_PENDING:
            for s in family.samples:
                cq = s.labels[KUEUE_QUEUE_LABEL]
                pending[cq] = pending.get(cq, 0.0) + s.value  # active + inadmissible
    if not (buckets if leader is None else leader):
        return None
    return Snapshot(at, buckets, pending)


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' histogram_quantile over cumulative `buckets` (None: no observation): the rank's
    bucket, linear inside it from the bucket below's bound (0 below the first); in the +Inf bucket the
    highest finite bound."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return None
    total = buckets[math.inf]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == math.inf:
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def growth(new: Buckets, old: Buckets | None) -> Buckets | None:
    """The observations between two snapshots, bucket by bucket; None when a bucket went down (a
    restarted counter: the older snapshot is no base)."""
    old = old or {}
    out = {le: new[le] - old.get(le, 0.0) for le in new}
    return None if any(v < 0 for v in out.values()) else out


@dataclass
class TrailingSnapshots:
    """Scrapes of cumulative counters over the trailing `seconds` (each with its time `at`), kept so that
    one at or before the window's start stays: the base the growth is measured from. A restart of the
    counters' source (said by the caller, which knows its series) starts the window again."""

    seconds: float
    snapshots: deque = field(default_factory=deque)

    @property
    def last(self):
        return self.snapshots[-1] if self.snapshots else None

    def add(self, snap, restarted: bool) -> None:
        if restarted:
            self.snapshots.clear()
        self.snapshots.append(snap)
        while len(self.snapshots) > 1 and self.snapshots[1].at <= snap.at - self.seconds:
            self.snapshots.popleft()


class Window(TrailingSnapshots):
    """The snapshots of the trailing `seconds` and what they say per ClusterQueue."""

    def add(self, snap: Snapshot) -> None:
        last = self.last  # a new leader's counters: lower
        lower = last is not None and any(growth(b, last.buckets.get(cq)) is None for cq, b in snap.buckets.items())
        super().add(snap, restarted=lower)

    def queues(self) -> dict[str, tuple[float, float]]:
        """ClusterQueue -> (the wait p95 in seconds, the workloads admitted within the window). A single
        snapshot says nothing about when its observations were made: nothing admitted yet."""
        if not self.snapshots:
            return {}
        first, last = self.snapshots[0], self.snapshots[-1]
        out: dict[str, tuple[float, float]] = {}
        for cq in sorted({*last.buckets, *last.pending}):
            grown = (growth(last.buckets.get(cq, {}), first.buckets.get(cq)) or {}) if first is not last else {}
            admitted = grown.get(math.inf, 0.0)
            p95 = quantile(QUANTILE, grown) if admitted > 0 else None
            out[cq] = (0.0 if p95 is None else p95, admitted)
        return out


def oldest_pending_s(summary: Mapping, now: float, min_priority: int) -> float:
    """The age of the oldest pending workload at or above `min_priority` in a visibility API
    PendingWorkloadsSummary (its creation: a requeued workload counts from its first queueing), 0: none."""
    ages = [
        now - datetime.fromisoformat(item["metadata"]["creationTimestamp"].replace("Z", "+00:00")).timestamp()
        for item in summary.get("items") or []
        if item.get("priority", 0) >= min_priority
    ]
    return max([0.0, *ages])


def fetch(url: str, token_file: Path | None, timeout_s: float, ca_file: str | None = None) -> str:
    """`url` with the pod's token. Kueue's metrics certificate is self-signed (`ca_file` None: not verified,
    as upstream's ServiceMonitor; the API server authenticates and authorises the token); the API server's
    is verified against the cluster's CA (`ca_file`)."""
    request = urllib.request.Request(url)
    if token_file is not None:
        request.add_header("Authorization", f"Bearer {token_file.read_text(encoding='utf-8').strip()}")
    context = ssl.create_default_context(cafile=ca_file)
    if ca_file is None:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with urllib.request.urlopen(request, timeout=timeout_s, context=context) as r:  # noqa: S310 (https only)
        return r.read().decode("utf-8")


def watch(args: argparse.Namespace) -> int:
    wait = Gauge(QUEUE_WAIT_P95, "queue wait p95 over the window, per ClusterQueue", [KUEUE_QUEUE_LABEL])
    admitted = Gauge(QUEUE_ADMITTED_IN_WINDOW, "workloads admitted within the window", [KUEUE_QUEUE_LABEL])
    oldest = Gauge(
        QUEUE_OLDEST_PENDING, "age of the oldest pending workload at or above the floor", [KUEUE_QUEUE_LABEL]
    )
    start_http_server(args.port)
    window = Window(args.window_s)
    token = None if args.token_file == "" else Path(args.token_file)
    while True:
        try:
            snap = parse(fetch(args.source, token, args.timeout_s), time.time())
        except (OSError, ValueError) as e:  # the endpoint away for a scrape: the gauges keep their values
            print(f"queue_wait: {args.source}: {e}", file=sys.stderr, flush=True)
            snap = None
        if snap is not None:
            window.add(snap)
            for cq, (p95, n) in window.queues().items():
                wait.labels(cq).set(p95)
                admitted.labels(cq).set(n)
                url = args.api.rstrip("/") + PENDING_PATH.format(urllib.parse.quote(cq, safe=""))
                try:
                    summary = json.loads(fetch(url, token, args.timeout_s, args.ca_file or None))
                    oldest.labels(cq).set(oldest_pending_s(summary, time.time(), args.min_priority))
                except (OSError, ValueError, KeyError) as e:
                    print(f"queue_wait: {url}: {e}", file=sys.stderr, flush=True)
        time.sleep(args.interval_s)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supernode.trainer.queue_wait", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("watch", help="relay Kueue's wait histogram as per-queue p95 gauges")
    w.add_argument("--source", required=True, help="Kueue's metrics URL (https)")
    w.add_argument("--token-file", default=SERVICE_ACCOUNT_TOKEN, help="bearer token file ('' for none)")
    w.add_argument("--window-s", type=float, default=3600.0)
    w.add_argument("--interval-s", type=float, default=30.0)
    w.add_argument("--timeout-s", type=float, default=10.0)
    w.add_argument("--port", type=int, default=9400)
    w.add_argument("--api", default="https://kubernetes.default.svc", help="the API server (the visibility API)")
    w.add_argument("--ca-file", default=SERVICE_ACCOUNT_CA, help="the API server's CA ('' not to verify)")
    w.add_argument("--min-priority", type=int, default=0, help="oldest pending: workloads at or above this only")
    args = p.parse_args(argv)
    if args.window_s <= 0 or args.interval_s <= 0:
        p.error("--window-s and --interval-s must be positive")
    return watch(args)


if __name__ == "__main__":
    sys.exit(main())
