"""Serving SLOs per served model, as gauges the CloudWatch agent can carry (issue 38, item 4).

    python -m supernode.trainer.serving_slo watch --source 'http://127.0.0.1:9090/federate?match[]=...'

vLLM measures each request's time to first token and each gap between its output tokens in histograms
(vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, by model_name and engine). The
CloudWatch agent's Prometheus scrape drops every histogram series (supernode/core/observability.py), so
no percentile reaches CloudWatch from the agent alone. This relay, beside the serving Prometheus (which
scrapes every serving pod), reads vLLM's series from its federation endpoint once an `--interval-s`
(or one server's /metrics directly, over TLS verified against `--ca-file`), keeps the snapshots of the
trailing `--window-s`, and exports per model (summed over its replicas and their data-parallel engines):

- supernode_serving_ttft_p99_seconds, supernode_serving_itl_p99_seconds: the 99th percentile of the
  observations within the window (from the buckets' growth, as Prometheus' histogram_quantile; the
  queue-wait relay's arithmetic, supernode.trainer.queue_wait); 0 when none;
- supernode_serving_requests_per_s: requests finished within the window, per second;
- supernode_serving_error_ratio: of those, the share vLLM finished with reason "error" (a 500); 0 when none;
- supernode_serving_requests_waiting / _running: the queue depth and the requests decoding, now.

A counter that went down or a series that went away (a server restarted, or a replica scaled away, whose
share leaves the sums) starts the window again: the figures then cover the time since.

Exit codes: 0 (stopped), 2 bad input.
"""

from __future__ import annotations

import argparse
import math
import ssl
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from supernode.core import observability as obs

from .queue_wait import Buckets, TrailingSnapshots, growth, quantile

QUANTILE = 0.99  # the targets' percentile (inference.ttftTargetMs / itlTargetMs are p99)
FINISHED, ERRORS = "finished", "errors"  # the request counter's two sums, kept as one-bucket "histograms"
Key = tuple[str, str]  # (series, model_name)


@dataclass(frozen=True)
class Snapshot:
    at: float
    counts: Mapping[Key, Buckets]  # cumulative: the latency histograms, and the counters as {inf: total}
    gauges: Mapping[Key, float]  # the queue gauges, now


def _add(into: dict, key: Key, le: float, value: float) -> None:
    buckets = into.setdefault(key, {})
    buckets[le] = buckets.get(le, 0.0) + value  # the engines of a replica summed


def parse(text: str, at: float) -> Snapshot:
    counts: dict[Key, Buckets] = {}
    gauges: dict[Key, float] = {}
    histograms = {f"{h}_bucket": h for h in (obs.VLLM_TTFT, obs.VLLM_ITL)}
    for family in text_string_to_metric_families(text):
        # by the sample's name: Prometheus' federation types every series untyped, under its own name
        for s in family.samples:
            model = s.labels.get(obs.VLLM_MODEL_LABEL)
            if model is None:
                continue
            if s.name in histograms:
                _add(counts, (histograms[s.name], model), float(s.labels["le"]), s.value)
            elif s.name == f"{obs.VLLM_REQUEST_SUCCESS}_total":
                _add(counts, (FINISHED, model), math.inf, s.value)
                if s.labels.get(obs.VLLM_FINISHED_REASON_LABEL) == obs.VLLM_ERROR_REASON:
                    _add(counts, (ERRORS, model), math.inf, s.value)
            elif s.name in (obs.VLLM_REQUESTS_WAITING, obs.VLLM_REQUESTS_RUNNING):
                gauges[s.name, model] = gauges.get((s.name, model), 0.0) + s.value
    return Snapshot(at, counts, gauges)


@dataclass(frozen=True)
class Slo:
    ttft_p99_s: float
    itl_p99_s: float
    requests_per_s: float
    error_ratio: float
    waiting: float
    running: float


class Window(TrailingSnapshots):
    def add(self, snap: Snapshot) -> None:
        last = self.last
        # A restarted server's counters: lower, or gone until its first request (a labelled series exists
        # only once observed).
        restarted = last is not None and any(
            key not in snap.counts or growth(snap.counts[key], old) is None for key, old in last.counts.items()
        )
        super().add(snap, restarted)

    def models(self) -> dict[str, Slo]:
        """Model -> its SLO figures. A single snapshot says nothing about when its requests were made."""
        if not self.snapshots:
            return {}
        first, last = self.snapshots[0], self.snapshots[-1]
        span = last.at - first.at

        def grown(series: str, model: str) -> Buckets:
            if first is last:
                return {}
            return growth(last.counts.get((series, model), {}), first.counts.get((series, model))) or {}

        def p99(series: str, model: str) -> float:
            return quantile(QUANTILE, grown(series, model)) or 0.0

        out = {}
        for model in sorted({m for _, m in last.counts} | {m for _, m in last.gauges}):
            finished = grown(FINISHED, model).get(math.inf, 0.0)
            errors = grown(ERRORS, model).get(math.inf, 0.0)
            out[model] = Slo(
                ttft_p99_s=p99(obs.VLLM_TTFT, model),
                itl_p99_s=p99(obs.VLLM_ITL, model),
                requests_per_s=finished / span if span > 0 else 0.0,
                error_ratio=errors / finished if finished > 0 else 0.0,
                waiting=last.gauges.get((obs.VLLM_REQUESTS_WAITING, model), 0.0),
                running=last.gauges.get((obs.VLLM_REQUESTS_RUNNING, model), 0.0),
            )
        return out


def fetch(url: str, ca_file: str | None, timeout_s: float) -> str:
    """The metrics at `url`: the serving Prometheus over the pod's loopback (plain HTTP), or a server over
    TLS with the chain verified against the serving CA but not the host name (the certificate names the
    Service, not the pod's address); the metrics path needs no API key (vLLM guards only its API)."""
    context = None
    if url.startswith("https://"):
        context = ssl.create_default_context(cafile=ca_file)
        context.check_hostname = False
    with urllib.request.urlopen(url, timeout=timeout_s, context=context) as r:  # noqa: S310 (the pod's server)
        return r.read().decode("utf-8")


GAUGES = {
    obs.SERVING_TTFT_P99: ("ttft_p99_s", "time to first token, p99 over the window (s)"),
    obs.SERVING_ITL_P99: ("itl_p99_s", "inter-token latency, p99 over the window (s)"),
    obs.SERVING_REQUESTS_PER_S: ("requests_per_s", "requests finished per second over the window"),
    obs.SERVING_ERROR_RATIO: ("error_ratio", "share of the window's finished requests that failed in the server"),
    obs.SERVING_REQUESTS_WAITING: ("waiting", "requests waiting for the engine (queue depth)"),
    obs.SERVING_REQUESTS_RUNNING: ("running", "requests being decoded"),
}


def watch(args: argparse.Namespace) -> int:
    gauges = {name: Gauge(name, help_, [obs.VLLM_MODEL_LABEL]) for name, (_, help_) in GAUGES.items()}
    start_http_server(args.port)
    window = Window(args.window_s)
    while True:
        try:
            window.add(parse(fetch(args.source, args.ca_file or None, args.timeout_s), time.time()))
        except (OSError, ValueError) as e:  # the server away for a read (loading, restarting): values stay
            print(f"serving_slo: {args.source}: {e}", file=sys.stderr, flush=True)
        for model, slo in window.models().items():
            for name, (attr, _) in GAUGES.items():
                gauges[name].labels(model).set(getattr(slo, attr))
        time.sleep(args.interval_s)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supernode.trainer.serving_slo", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("watch", help="relay vLLM's latency histograms as per-model p99 gauges")
    w.add_argument("--source", required=True, help="the server's metrics URL")
    w.add_argument("--ca-file", default="", help="the serving CA (PEM) the server's certificate chains to")
    w.add_argument("--window-s", type=float, default=300.0)
    w.add_argument("--interval-s", type=float, default=15.0)
    w.add_argument("--timeout-s", type=float, default=10.0)
    w.add_argument("--port", type=int, default=9401)
    args = p.parse_args(argv)
    if args.window_s <= 0 or args.interval_s <= 0:
        p.error("--window-s and --interval-s must be positive")
    return watch(args)


if __name__ == "__main__":
    sys.exit(main())
