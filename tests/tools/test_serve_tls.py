"""`supernode serve --local --tls`: HTTPS with a certificate made for the server, and an API key every API
request must carry, as the cluster's server runs (components/k8s/credentials.py). One vLLM start checks
both (slow; skipped without the serving environment); the command line is checked without one."""

from __future__ import annotations

import http.client
import json
import ssl
import stat
import warnings
from pathlib import Path

import pytest

from supernode.core.errors import BadInput
from supernode.core.serving import BACKEND
from supernode.tools import serve as S

ROOT = Path(__file__).resolve().parents[2]


def _manifested(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"max_position_embeddings": 64}')
    (d / "manifest.json").write_text(json.dumps({"architecture": "Glm4MoeForCausalLM", "dtype": "bf16", "files": {}}))
    return d


def test_the_tls_command_names_the_certificate_and_never_the_key(tmp_path):
    server = S.LocalServer(_manifested(tmp_path / "m"), Path("/py"), port=4321, tls=True)
    cmd = server.command()
    key, cert = (cmd[cmd.index(flag) + 1] for flag in ("--ssl-keyfile", "--ssl-certfile"))
    assert Path(key).read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert stat.S_IMODE(Path(key).stat().st_mode) == 0o600
    assert "BEGIN CERTIFICATE" in Path(cert).read_text()
    assert server.api_key and server.api_key not in " ".join(cmd) and "--api-key" not in cmd
    assert server.url == "https://127.0.0.1:4321"
    # the certificate is signed by the server's own CA and names 127.0.0.1: a client trusting the CA verifies it
    from cryptography import x509

    ca = x509.load_pem_x509_certificate(server.ca_pem.encode())
    leaf = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    leaf.verify_directly_issued_by(ca)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    server.stop()
    assert not Path(key).exists()  # the credentials go with the server
    plain = S.LocalServer(_manifested(tmp_path / "p"), Path("/py"), port=4321)
    assert "--ssl-keyfile" not in plain.command() and plain.url.startswith("http://")


def _tiny_export(tmp_path: Path) -> Path:
    pytest.importorskip("torch")
    from supernode.core.config import Model
    from supernode.trainer.hf.export import export
    from tests.trainer.test_export import _checkpoint

    m = Model(
        layers=2,
        dim=128,
        heads=2,
        kv_heads=1,
        experts=4,
        top_k=2,
        shared_experts=1,
        expert_hidden=64,
        dense_hidden=192,
        first_dense_layers=1,
        vocab=256,
        seq_len=64,
        router="sigmoid",
    )
    _, path = _checkpoint(tmp_path, m)
    out = tmp_path / "hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        export(path, out, dtype="bf16", say=lambda s: None)
    return out


def _status(url: str, path: str, body: dict | None = None, key: bool = True) -> int:
    return S._request("POST" if body else "GET", url + path, body, timeout=30, key=key)[0]


@pytest.mark.slow
def test_a_tls_server_refuses_requests_without_the_key_and_plain_http(tmp_path):
    try:
        python = S.serve_python(ROOT)
    except BadInput as e:
        pytest.skip(f"no serving environment: {e}")
    model = _tiny_export(tmp_path)
    completion = {"model": "supernode", "prompt": [3, 14, 15], "max_tokens": 4, "temperature": 0}
    with S.LocalServer(model, python, max_num_seqs=2, ready_timeout_s=600, tls=True) as server:
        url = server.url
        assert url.startswith("https://")
        # the API: refused without the key, answered with it
        assert _status(url, "/v1/completions", completion, key=False) == 401
        assert _status(url, "/v1/models", key=False) == 401
        assert _status(url, "/v1/completions", completion) == 200
        assert len(S.greedy_token_ids(url, [3, 14, 15], 4, model=server.name)) == 4
        # health and metrics need no key: the probes and the serving Prometheus' scrape are unaffected
        assert _status(url, BACKEND.health_path, key=False) == 200
        status, body = S._request("GET", url + BACKEND.metrics_path, timeout=30, key=False)
        assert status == 200 and all(s.encode() in body for s in BACKEND.in_flight_series)
        # a client that does not trust the server's CA does not connect; plain HTTP gets no answer
        strict = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=ssl.create_default_context())
        with pytest.raises(ssl.SSLCertVerificationError):
            strict.request("GET", BACKEND.health_path)
        plain = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("GET", "/v1/models")
            plain.getresponse()
