"""`supernode serve`: weights verified by sha256 before any server starts; the server lifecycle.

The vLLM equality test (greedy tokens of vLLM == transformers on an exported model) is slow and needs
the serving environment (`make serve-env`); it is skipped without one.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import warnings
from pathlib import Path

import pytest

from supernode.cli import main
from supernode.core.errors import BadInput
from supernode.tools.serve import PYTHON_ENV, LocalServer, ServerFailed, verify_export

ROOT = Path(__file__).resolve().parents[2]


def _export(d: Path) -> Path:
    """A model directory with a manifest, as trainer.hf.export writes one (contents irrelevant here)."""
    d.mkdir(parents=True)
    files = {
        "config.json": b'{"max_position_embeddings": 64}',
        "model-00001.safetensors": os.urandom(4096),
        "tokenizer.json": b"{}",
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "manifest.json").write_text(
        json.dumps(
            {
                "architecture": "Glm4MoeForCausalLM",
                "dtype": "bf16",
                "files": {n: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for n, b in files.items()},
            }
        )
    )
    return d


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> Path:
    """A 'serving python' that records that it was started: a server must never start on bad weights."""
    started = tmp_path / "started"
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\necho "$@" > {started}\nexit 3\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(PYTHON_ENV, str(script))
    return started


def test_verify_accepts_an_intact_export(tmp_path):
    assert verify_export(_export(tmp_path / "m"))["architecture"] == "Glm4MoeForCausalLM"


def test_corrupted_weight_file_blocks_serve(tmp_path, fake_vllm, capsys):
    model = _export(tmp_path / "m")
    weights = model / "model-00001.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF  # one flipped byte
    weights.write_bytes(bytes(data))
    rc = main(["serve", "--stack", "dev", "--root", str(ROOT), "--local", "--model", str(model), "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "model-00001.safetensors" in err and "does not match manifest.json" in err
    assert "Traceback" not in err
    assert not fake_vllm.exists()  # the server never started


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: listed in manifest.json but missing"),
        (lambda d: (d / "model-00002.safetensors").write_bytes(b"x"), "model-00002.safetensors: not listed"),
        (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
        (lambda d: (d / "manifest.json").write_text("{"), "not an export manifest"),
    ],
)
def test_other_damage_is_named(tmp_path, damage, needle):
    model = _export(tmp_path / "m")
    damage(model)
    with pytest.raises(BadInput, match=needle):
        verify_export(model)


def test_manifest_pin(tmp_path):
    model = _export(tmp_path / "m")
    digest = hashlib.sha256((model / "manifest.json").read_bytes()).hexdigest()
    verify_export(model, digest)
    with pytest.raises(BadInput, match="is not inference.manifestSha256"):
        verify_export(model, "0" * 64)


def test_serve_needs_local_and_a_serving_env(tmp_path, capsys, monkeypatch):
    assert main(["serve", "--stack", "dev", "--root", str(ROOT), "--model", str(tmp_path)]) == 2
    assert "--local" in capsys.readouterr().err
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "nope" / "python"))
    model = _export(tmp_path / "m")
    assert main(["serve", "--stack", "dev", "--root", str(ROOT), "--local", "--model", str(model)]) == 2
    assert "make serve-env" in capsys.readouterr().err


def test_a_server_that_dies_at_start_is_reported_with_its_log(tmp_path, fake_vllm):
    server = LocalServer(_export(tmp_path / "m"), Path(os.environ[PYTHON_ENV]), ready_timeout_s=30)
    with pytest.raises(ServerFailed, match=r"the server exited \(3\) before it was ready"):
        server.start()
    assert "--max-model-len 64" in fake_vllm.read_text()  # from the export's config.json


def test_the_local_server_runs_the_backend_with_the_exports_settings(tmp_path):
    model = _export(tmp_path / "m")
    cmd = LocalServer(model, Path("/py"), port=8001, max_num_seqs=64).command()
    flags = {a: (b if not b.startswith("--") else None) for a, b in zip(cmd[3:], cmd[4:] + [""]) if a.startswith("--")}
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert flags["--model"] == str(model) and flags["--served-model-name"] == "supernode"
    assert flags["--dtype"] == "bfloat16" and flags["--max-model-len"] == "64"  # the manifest's, config.json's
    assert flags["--max-num-seqs"] == "64" and flags["--port"] == "8001" and flags["--host"] == "127.0.0.1"
    assert "--enforce-eager" in flags and "--skip-tokenizer-init" not in flags
    (model / "tokenizer.json").unlink()  # an export of data without a tokenizer: token ids in and out
    assert "--skip-tokenizer-init" in LocalServer(model, Path("/py")).command()


SERVE_PY = ROOT / ".venv-serve" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not SERVE_PY.is_file(), reason="no serving environment (make serve-env)")
def test_vllm_greedy_equals_transformers_greedy(tmp_path, monkeypatch):
    """On an fp32 export of a model with a sigmoid router, shared expert and a dense first layer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from supernode.core.config import Model
    from supernode.tools.serve import greedy_token_ids
    from tests.trainer.test_export import _checkpoint
    from trainer.hf.export import export

    monkeypatch.delenv(PYTHON_ENV, raising=False)
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
        export(path, out, dtype="fp32", say=lambda s: None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompts = [[3, 14, 15, 92, 65], [27, 18, 28, 18, 28, 45, 90]]
    with LocalServer(out, SERVE_PY, max_num_seqs=4, ready_timeout_s=600) as server:
        for prompt in prompts:
            ids = greedy_token_ids(server.url, prompt, 16, model=server.name)
            want = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
            assert ids == want
