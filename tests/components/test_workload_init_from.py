"""`training.initFrom` in the cluster: the trainer's pods verify the pretrained weights in an init container
(supernode.trainer.hf.fetch) before the trainer starts, from FSx (mounted read-only) or S3 (downloaded,
here against a moto server). The manifests validate against the Kubernetes and CRD schemas."""

from __future__ import annotations

import json
import socket

import pytest
from moto.server import ThreadedMotoServer
from test_workload import ROOT, objects, preview, worker

from supernode.core.config import from_mapping, load_stack
from supernode.core.files import sha256_file
from supernode.core.plan import Plan
from supernode.core.pretrained import MANIFEST, write_manifest
from supernode.tools import manifests as mf
from supernode.trainer.hf.fetch import main as fetch

PIN = "ab" * 32


def _with_init_from(source: str):
    data = load_stack("dev", ROOT).to_mapping()
    data["training"].update(initFrom=source, initFromSha256=PIN)
    cfg = from_mapping(data)
    return cfg, preview("dev", cfg)


@pytest.mark.parametrize("source", ["/fsx/models/qwen3-moe", "s3://weights-bucket/models/qwen3-moe/"])
def test_the_job_verifies_the_weights_before_the_trainer_starts(source):
    cfg, result = _with_init_from(source)
    _, spec = worker(result)
    pod = spec["template"]["spec"]
    (init,) = pod["initContainers"]
    (trainer,) = pod["containers"]
    assert init["command"][:3] == ["python", "-m", "supernode.trainer.hf.fetch"]
    assert init["command"][init["command"].index("--sha256") + 1] == PIN  # the pin travels with the job
    assert trainer["args"][trainer["args"].index("--init-from") + 1] == "/pretrained"
    mount = next(m for m in trainer["volumeMounts"] if m["mountPath"] == "/pretrained")
    assert mount["readOnly"] is True  # the trainer never writes the weights
    (init_mount,) = init["volumeMounts"]
    if source.startswith("s3://"):
        assert init["command"][init["command"].index("--from") + 1] == source
        assert init_mount["readOnly"] is False and mount["name"] == "pretrained"
        assert {"name": "pretrained", "emptyDir": {}} in pod["volumes"]
    else:  # verified in place on FSx: the subPath is the path inside the file system
        assert init_mount == {**mount, "readOnly": True} and mount == {
            "name": "fsx",
            "mountPath": "/pretrained",
            "subPath": "models/qwen3-moe",
            "readOnly": True,
        }
    (plan,) = [
        Plan.from_json(m["data"]["plan.json"])
        for (kind, _), m in objects(result).items()
        if kind == "ConfigMap" and "plan.json" in (m.get("data") or {})
    ]
    assert plan.training.init_from == source and plan.training.init_from_sha256 == PIN  # the plan records both
    assert mf.validate(mf.from_resources(result.resources), cfg.cluster.kubernetes_version) == []


def test_without_init_from_there_is_no_init_container():
    _, spec = worker(preview("dev", load_stack("dev", ROOT)))
    assert "initContainers" not in spec["template"]["spec"]
    assert "--init-from" not in spec["template"]["spec"]["containers"][0]["args"]


# -- the init container's program against S3 (moto) -----------------------------------------------


@pytest.fixture
def s3(monkeypatch, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="weights")
    yield client
    server.stop()


def _model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    write_manifest(d, "Qwen3MoeForCausalLM")
    return d


def test_fetch_downloads_from_s3_and_verifies_against_the_pin(s3, tmp_path, capsys):
    d = _model_dir(tmp_path)
    for f in d.iterdir():
        s3.upload_file(str(f), "weights", f"models/m/{f.name}")
    pin = sha256_file(d / MANIFEST)
    assert fetch(["--from", "s3://weights/models/m/", "--to", str(tmp_path / "a"), "--sha256", pin]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()
    assert fetch(["--from", "s3://weights/models/m", "--to", str(tmp_path / "b"), "--sha256", "0" * 64]) == 2
    assert "is not training.initFromSha256" in capsys.readouterr().err

    flipped = bytearray((d / "model.safetensors").read_bytes())
    flipped[7] ^= 0x01
    s3.put_object(Bucket="weights", Key="models/m/model.safetensors", Body=bytes(flipped))
    assert fetch(["--from", "s3://weights/models/m/", "--to", str(tmp_path / "c"), "--sha256", pin]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'c' / 'model.safetensors'}: sha256" in err and len(err.strip().splitlines()) == 1


def test_fetch_verifies_an_fsx_directory_in_place(tmp_path, capsys):
    d = _model_dir(tmp_path)
    assert fetch(["--from", str(d), "--to", str(tmp_path / "unused")]) == 0
    assert not (tmp_path / "unused").exists()
    (d / "extra.safetensors").write_bytes(b"x")
    assert fetch(["--from", str(d), "--to", str(tmp_path / "unused")]) == 2
    assert "extra.safetensors: not listed in manifest.json" in capsys.readouterr().err
