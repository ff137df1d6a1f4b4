"""The serving SLO relay (supernode.trainer.serving_slo): vLLM's latency histograms and request counter
-> per-model p99, request rate and error ratio gauges over the trailing window, from the exposition
format prometheus_client writes for vLLM's series (vLLM registers them with prometheus_client)."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from supernode.core import observability as obs
from supernode.core.credentials import generate
from supernode.trainer import serving_slo as slo

# The pinned vLLM's buckets (vllm/v1/metrics/buckets.py: TIME_TO_FIRST_TOKEN_BUCKETS, INTER_TOKEN_LATENCY_BUCKETS).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
LABELS = ["model_name", "engine"]


class FakeVllm:
    """vLLM's series for one served model over two data-parallel engines, as its registry exposes them."""

    def __init__(self, model: str = "prod-vllm"):
        self.registry = CollectorRegistry()
        self.model = model
        self.ttft = Histogram(obs.VLLM_TTFT, "ttft", LABELS, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(obs.VLLM_ITL, "itl", LABELS, buckets=ITL_BUCKETS, registry=self.registry)
        self.success = Counter(
            obs.VLLM_REQUEST_SUCCESS, "finished", [*LABELS, "finished_reason"], registry=self.registry
        )
        self.waiting = Gauge(obs.VLLM_REQUESTS_WAITING, "waiting", LABELS, registry=self.registry)
        self.running = Gauge(obs.VLLM_REQUESTS_RUNNING, "running", LABELS, registry=self.registry)

    def requests(self, ttfts: list[float], itl: float, engine: str = "0", reason: str = "stop") -> None:
        for t in ttfts:
            self.ttft.labels(self.model, engine).observe(t)
            self.itl.labels(self.model, engine).observe(itl)
            self.success.labels(self.model, engine, reason).inc()

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_parse_sums_the_engines_and_counts_errors_apart():
    v = FakeVllm()
    v.requests([0.05] * 3, 0.02, engine="0")
    v.requests([0.3], 0.02, engine="1", reason="error")
    v.waiting.labels(v.model, "0").set(5)
    v.waiting.labels(v.model, "1").set(2)
    snap = slo.parse(v.text(), at=0.0)
    assert snap.counts[obs.VLLM_TTFT, v.model][math.inf] == 4
    assert snap.counts[slo.FINISHED, v.model] == {math.inf: 4} and snap.counts[slo.ERRORS, v.model] == {math.inf: 1}
    assert snap.gauges[obs.VLLM_REQUESTS_WAITING, v.model] == 7


def test_the_p99_rate_and_error_ratio_are_of_the_window_not_of_all_time():
    v, w = FakeVllm(), slo.Window(300)
    v.requests([10.0] * 50, 2.0)  # a slow start, before the window
    w.add(slo.parse(v.text(), at=0.0))
    v.requests([0.05] * 198, 0.02)
    v.requests([0.05] * 2, 0.02, reason="error")
    w.add(slo.parse(v.text(), at=300.0))  # the base: the window starts here
    v.requests([0.07] * 99, 0.02)
    v.requests([0.9], 0.4, reason="error")  # the one slow request of 100
    w.add(slo.parse(v.text(), at=600.0))
    [(model, s)] = w.models().items()
    assert model == v.model
    # 100 requests in the window: rank 99 lies in (0.06, 0.08], 99/99 of the way: 0.08 (the 10 s start is gone)
    assert s.ttft_p99_s == pytest.approx(0.08) and s.itl_p99_s == pytest.approx(0.025)
    assert s.requests_per_s == pytest.approx(100 / 300) and s.error_ratio == pytest.approx(0.01)


def test_a_single_snapshot_and_a_restart_report_nothing_finished():
    v, w = FakeVllm(), slo.Window(300)
    v.requests([0.05] * 10, 0.02)
    w.add(slo.parse(v.text(), at=0.0))
    assert w.models()[v.model].requests_per_s == 0 and w.models()[v.model].ttft_p99_s == 0
    w.add(slo.parse(FakeVllm().text(), at=30.0))  # a restarted server: no series until its first request
    assert len(w.snapshots) == 1
    restarted = FakeVllm()
    restarted.requests([0.05] * 3, 0.02)
    w.add(slo.parse(restarted.text(), at=60.0))
    assert w.models()[v.model].requests_per_s == pytest.approx(3 / 30)  # counted from the restart


def _serve(text: str, tls: dict[str, str], tmp: Path) -> ThreadingHTTPServer:
    import ssl

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    (tmp / "cert").write_text(tls["cert_pem"])
    (tmp / "key").write_text(tls["key_pem"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp / "cert", tmp / "key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_relay_reads_its_tls_server_and_serves_the_gauges(tmp_path):
    """The relay process as the sidecar runs it: a TLS server whose certificate names the Service (not
    127.0.0.1), verified against the serving CA; its gauges on its own port, labelled by model."""
    tls = generate(["prod-vllm.serving.svc"], valid_days=1)
    (tmp_path / "ca").write_text(tls["ca_pem"])
    v = FakeVllm()
    v.requests([0.05] * 10, 0.02)
    v.waiting.labels(v.model, "0").set(3)
    server = _serve(v.text(), tls, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = f"https://127.0.0.1:{server.server_address[1]}/metrics"
    args = ["watch", "--source", source, "--ca-file", str(tmp_path / "ca"), "--port", str(port), "--interval-s", "0.2"]
    relay = subprocess.Popen([sys.executable, "-m", "supernode.trainer.serving_slo", *args], stderr=subprocess.PIPE)
    try:
        deadline, body = time.monotonic() + 30, ""
        while (
            time.monotonic() < deadline and f'{obs.SERVING_REQUESTS_WAITING}{{model_name="prod-vllm"}} 3.0' not in body
        ):
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.2)
        assert f'{obs.SERVING_REQUESTS_WAITING}{{model_name="prod-vllm"}} 3.0' in body, body
        assert all(name in body for name in obs.SERVING_SLO_METRICS)
    finally:
        relay.terminate()
        err = relay.communicate(timeout=10)[1].decode()
        server.shutdown()
    assert "CERTIFICATE_VERIFY_FAILED" not in err


def test_federated_series_of_two_pods_are_summed_per_model():
    """Prometheus' /federate writes each series untyped under its own name, with the scrape's labels and a
    timestamp (web/federate.go); two replicas' series of one model sum."""
    lines = []
    for name in (f"{obs.VLLM_TTFT}_bucket", f"{obs.VLLM_REQUEST_SUCCESS}_total", obs.VLLM_REQUESTS_WAITING):
        lines.append(f"# TYPE {name} untyped")
        for pod_name, n in (("a", 3), ("b", 5)):
            labels = f'engine="0",instance="10.0.0.{n}:8000",job="vllm",model_name="prod-vllm",pod="{pod_name}"'
            if name.endswith("_bucket"):
                lines += [
                    f'{name}{{{labels},le="0.1"}} {n} 1700000000000',
                    f'{name}{{{labels},le="+Inf"}} {n} 1700000000000',
                ]
            elif name.endswith("_total"):
                lines.append(f'{name}{{{labels},finished_reason="error"}} {n} 1700000000000')
            else:
                lines.append(f"{name}{{{labels}}} {n} 1700000000000")
    snap = slo.parse("\n".join(lines) + "\n", at=0.0)
    assert snap.counts[obs.VLLM_TTFT, "prod-vllm"] == {0.1: 8, math.inf: 8}
    assert snap.counts[slo.ERRORS, "prod-vllm"] == {math.inf: 8}
    assert snap.gauges[obs.VLLM_REQUESTS_WAITING, "prod-vllm"] == 8
