"""`supernode verify`'s serving request against real local servers (tests/tools/completions_server.py):
one answering as vLLM does passes; a wrong answer, a slow first token, slow tokens, a refused connection,
a wrong API key and a certificate from another CA each fail with their reason."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from supernode.cli import main
from supernode.core.config import load_stack
from supernode.core.credentials import generate
from supernode.core.plan import build_plan
from supernode.tools.verify import ServingProbe, check_serving
from tests.tools.completions_server import Behaviour, completions_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan():
    """dev's inference plan with the targets the checks judge against (dev sets none)."""
    ip = build_plan("dev", load_stack("dev", ROOT)).inference
    return ip.model_copy(update={"ttft_target_ms": 300.0, "itl_target_ms": 100.0})


@pytest.fixture(scope="module")
def tls():
    return generate(["localhost"], valid_days=1, ip_addresses=("127.0.0.1",))


def probe(url: str, **kw) -> ServingProbe:
    return ServingProbe(url=url, model="dev-vllm", expect="Paris", timeout_s=10, **kw)


def test_an_answer_within_the_targets_over_tls_with_the_api_key_passes(plan, tls):
    with completions_server(Behaviour(api_key=tls["api_key"]), tls) as (url, requests):
        check = check_serving(probe(url, api_key=tls["api_key"], ca_pem=tls["ca_pem"]), plan)
    assert check.result == "pass", check
    assert "4 tokens" in check.detail and "answer 'Paris. It is'" in check.detail
    assert "within TTFT target 300 ms, ITL target 100 ms" in check.detail
    [request] = requests
    assert request["path"] == "/v1/completions" and request["authorization"] == f"Bearer {tls['api_key']}"
    assert request["body"]["model"] == "dev-vllm" and request["body"]["stream"] is True


def test_a_wrong_answer_fails(plan):
    with completions_server(Behaviour(tokens=(" London",))) as (url, _):
        check = check_serving(probe(url), plan)
    assert check.result == "fail" and "expected an answer containing 'Paris', got ' London'" in check.detail


def test_an_empty_answer_fails_without_an_expected_text(plan):
    with completions_server(Behaviour(tokens=())) as (url, _):
        check = check_serving(ServingProbe(url=url, model="dev-vllm", timeout_s=10), plan)
    assert check.result == "fail" and "expected a non-empty answer" in check.detail


def test_a_slow_first_token_fails_naming_the_target_and_the_estimate(plan):
    with completions_server(Behaviour(first_token_s=0.5)) as (url, _):
        check = check_serving(probe(url), plan)
    assert check.result == "fail", check
    assert "TTFT" in check.detail and "over the 300 ms target" in check.detail
    assert f"the plan estimates {plan.ttft_ms:.0f} ms" in check.detail and "ITL" not in check.detail.split("(")[0]


def test_slow_tokens_fail_on_the_itl_target(plan):
    with completions_server(Behaviour(between_tokens_s=0.2)) as (url, _):
        check = check_serving(probe(url), plan)
    assert check.result == "fail" and "over the 100 ms target" in check.detail and "ITL" in check.detail


def test_no_target_judges_no_latency(plan):
    untargeted = plan.model_copy(update={"ttft_target_ms": None, "itl_target_ms": None})
    with completions_server(Behaviour(first_token_s=0.4)) as (url, _):
        check = check_serving(probe(url), untargeted)
    assert check.result == "pass" and "within" not in check.detail


def test_a_refused_connection_fails(plan):
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check = check_serving(probe(f"http://127.0.0.1:{port}"), plan)
    assert check.result == "fail" and "ConnectionRefusedError" in check.detail


def test_a_wrong_api_key_is_named(plan, tls):
    with completions_server(Behaviour(api_key=tls["api_key"]), tls) as (url, _):
        check = check_serving(probe(url, api_key="not-the-key", ca_pem=tls["ca_pem"]), plan)
    assert check.result == "fail" and "the API key was refused" in check.detail and "401" in check.detail
    assert "serving_api_key" in check.fix


def test_a_certificate_from_another_ca_fails_verification(plan, tls):
    other = generate(["localhost"], valid_days=1, ip_addresses=("127.0.0.1",))
    with completions_server(Behaviour(), tls) as (url, requests):
        check = check_serving(probe(url, ca_pem=other["ca_pem"]), plan)
    assert check.result == "fail" and "SSLCertVerificationError" in check.detail
    assert requests == []  # nothing (no key) was sent to a server the CA does not vouch for


def test_cli_bad_serving_flags_exit_2(tmp_path, capsys):
    outputs = tmp_path / "out.json"
    outputs.write_text("{}", encoding="utf-8")
    base = ["verify", "--stack", "dev", "--root", str(ROOT), "--outputs", str(outputs)]
    assert main([*base, "--serving-url", "ftp://x:1"]) == 2
    assert "--serving-url: expected http(s)://HOST:PORT, got 'ftp://x:1'" in capsys.readouterr().err
    assert main([*base, "--serving-url", "https://x:1", "--serving-ca", str(tmp_path / "nope.pem")]) == 2
    assert "--serving-ca: cannot read" in capsys.readouterr().err
