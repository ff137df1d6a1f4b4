"""The serving bench's TLS comparison: each level measured on both servers in alternating order, the
ratios HTTPS over HTTP, and the flags it refuses (a real vLLM run of it is in issue 38's note)."""

from __future__ import annotations

import json

import pytest

from supernode.bench import serve as bench


def test_compare_tls_alternates_the_servers_and_prints_https_over_http(monkeypatch, capsys):
    calls = []

    def level(url, name, concurrency, requests, max_tokens, prompts):
        calls.append((url, concurrency))
        slow = 2.0 if url.startswith("https") else 1.0  # the TLS server: twice the latency, half the rate
        return {
            "bench": "serve",
            "concurrency": concurrency,
            "ttft_ms_p50": 10 * slow,
            "ttft_ms_p99": 20 * slow,
            "itl_ms_p50": 5 * slow,
            "itl_ms_p99": 6 * slow,
            "latency_s_mean": 0.1 * slow,
            "tokens_per_s": 100.0 * concurrency / slow,
        }

    monkeypatch.setattr(bench, "level", level)
    args = bench.parse_args(["--compare-tls", "--concurrency", "4,16"])
    assert args.levels == [1, 4, 16]  # the sequential baseline added
    rows = bench.measure({"http": "http://h", "https": "https://h"}, args, bench.PROMPTS)
    assert calls == [
        ("http://h", 1),
        ("https://h", 1),
        ("https://h", 4),
        ("http://h", 4),
        ("http://h", 16),
        ("https://h", 16),
    ]
    assert [r["speedup_vs_sequential"] for r in rows["https"]] == [1.0, 4.0, 16.0]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ratios = [line["https_over_http"] for line in lines if line["bench"] == "serve_tls"]
    assert len(ratios) == 3
    assert all(r["ttft_ms_p50_ratio"] == 2.0 and r["tokens_per_s_ratio"] == 0.5 for r in ratios)
    assert {line.get("transport") for line in lines if line["bench"] == "serve"} == {"http", "https"}


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--compare-tls", "--url", "http://x"], "--compare-tls starts its own two servers"),
        (["--compare-tls", "--tls"], "not allowed with argument"),
        (["--concurrency", "1,x"], "give comma-separated integers"),
        (["--requests", "0"], "must be at least 1"),
    ],
)
def test_bad_flags_exit_2_naming_them(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err
