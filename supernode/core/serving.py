"""The serving backend: what every path that runs a model server must know about the server program.

Three paths run one: the cluster's serving workload (components/k8s/serving.py: its container's
command, probes, the scrape and the HPA's metric), `supernode serve --local` (supernode/tools/serve.py)
and the serving bench (supernode/bench/serve.py, through the same local server). Each reads the server's command
line, health path and metric series from `BACKEND`, so they cannot drift apart, and none names the
program itself. What the paths share beyond the backend (the verified weights directory) is here too.

The image is the stack's (`inference.image`, pinned by digest per stack); the backend is what runs in it.
A second backend is one more `ServingBackend` below, selected as `BACKEND` (or per stack, by a field of
the inference section mapping to it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .inference import DTYPES

MODELS_DIR = "/models"  # where a serving pod's server reads the weights, once verified
VERIFY_CONTAINER = "verify-weights"  # the init container that verifies them (the policy pack looks for it)


@dataclass(frozen=True)
class ServerSpec:
    """One server process: what it serves and how. The cluster and the local server fill the same fields."""

    model_dir: str
    name: str  # the model name clients ask for
    dtype: str  # a key of inference.DTYPES
    max_seq_len: int
    max_concurrency: int  # sequences batched at once
    memory_fraction: float  # of each accelerator's memory the server may take
    host: str
    port: int
    tp: int = 1
    pp: int = 1
    dp: int = 1  # data-parallel ranks (engines) of the replica: with expert_parallel, vLLM's wide-EP layout
    expert_parallel: bool = False  # the routed experts spread over all dp x tp GPUs
    # A replica over several nodes (pods): each pod runs one server process with the group's size, its own
    # rank (a literal, or the $(VAR) the kubelet expands from the pod's env) and the leader's address;
    # ranks > 0 run headless (engines and workers only, no HTTP) and join the leader's.
    nnodes: int = 1
    node_rank: str = "0"
    master_addr: str | None = None
    master_port: int = 29501
    # TLS on the API port: the server's key and certificate files (PEM); None: plain HTTP.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    eager: bool = False  # no CUDA graphs: a CPU build has none to capture
    access_log: bool = True  # a line per request
    tokenizer: bool = True  # False (an export of data that had none): prompts and completions are token ids


@dataclass(frozen=True)
class ServingBackend:
    """A server of the OpenAI-compatible HTTP API for an exported model directory."""

    name: str  # the container, the workload's name, the scrape job, the local log
    module: str  # `python -m MODULE` starts the server
    flags: Callable[[ServerSpec], list[str]]  # its command-line flags for one ServerSpec
    health_path: str  # 200 once the model is loaded: startup, readiness and liveness
    metrics_path: str  # Prometheus text format
    series_prefix: str  # of every series the server exports
    # Gauges whose sum is the requests a server holds (running and queued): what the HPA scales on.
    in_flight_series: tuple[str, ...]
    # A rank > 0 of a replica over several nodes: `python -m GROUP_MODULE GROUP_SUBCOMMAND` (the server's
    # CLI, whose headless mode joins the leader without serving HTTP).
    group_module: str = ""
    group_subcommand: tuple[str, ...] = ()
    # The environment variable the server reads its API key from (the cluster sets it from a Secret, so
    # the key is never in the pod's command line); requests to the API without it are refused.
    api_key_env: str = ""
    # The local CPU build (supernode serve --local): its environment and memory fraction, and the
    # environment that gives each of a tensor-parallel server's ranks its own CPUs (a list per rank).
    cpu_env: Mapping[str, str] = field(default_factory=dict)
    cpu_memory_fraction: float = 1.0
    cpu_ranks_env: Callable[[list[list[int]]], dict[str, str]] = lambda cpus: {}

    def command(self, python: str = "python3") -> list[str]:
        return [python, "-m", self.module]

    def group_command(self, python: str = "python3") -> list[str]:
        """A headless rank's program (ServerSpec.node_rank > 0 of a multi-node replica)."""
        return [python, "-m", self.group_module, *self.group_subcommand]

    @property
    def in_flight_metric(self) -> str:
        """The custom metric the HPA reads: the sum of `in_flight_series` per pod."""
        return f"{self.name}_requests_in_flight"


def _vllm_flags(s: ServerSpec) -> list[str]:
    return [
        "--model",
        s.model_dir,
        "--served-model-name",
        s.name,
        "--dtype",
        DTYPES[s.dtype].torch_name,
        "--max-model-len",
        str(s.max_seq_len),
        "--max-num-seqs",
        str(s.max_concurrency),
        "--tensor-parallel-size",
        str(s.tp),
        "--pipeline-parallel-size",
        str(s.pp),
        *(["--data-parallel-size", str(s.dp)] if s.dp > 1 else []),
        *(["--enable-expert-parallel"] if s.expert_parallel else []),
        # vLLM's native multi-node launch (multiprocessing backend, no Ray): one process per node, the
        # world split evenly over --nnodes, rank 0 at --master-addr serving the API.
        *(
            [
                "--nnodes",
                str(s.nnodes),
                "--node-rank",
                s.node_rank,
                "--master-addr",
                s.master_addr or "",
                "--master-port",
                str(s.master_port),
                "--distributed-executor-backend",
                "mp",
            ]
            if s.nnodes > 1
            else []
        ),
        *(["--headless"] if s.nnodes > 1 and s.node_rank != "0" else []),
        *(
            ["--ssl-keyfile", s.ssl_keyfile, "--ssl-certfile", s.ssl_certfile]
            if s.ssl_keyfile and s.ssl_certfile
            else []
        ),
        "--gpu-memory-utilization",
        f"{s.memory_fraction:.2f}",
        "--host",
        s.host,
        "--port",
        str(s.port),
        *(["--enforce-eager"] if s.eager else []),
        *([] if s.access_log else ["--disable-uvicorn-access-log"]),
        *([] if s.tokenizer else ["--skip-tokenizer-init"]),
    ]


def _vllm_cpu_ranks_env(cpus: list[list[int]]) -> dict[str, str]:
    """vLLM's CPU workers bind their OpenMP threads to one NUMA node each by default, so tp 2 on a machine
    with one node fails ("Not enough allowed NUMA nodes"); an explicit list per rank works. None is held
    back for the scheduler: on 2 cores each rank needs its own (measured, issue 38's note)."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, rank)) for rank in cpus),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


VLLM = ServingBackend(
    name="vllm",
    # vllm-cpu's `vllm` console script does not start: the module does, in either build.
    module="vllm.entrypoints.openai.api_server",
    # `vllm serve` (vllm.entrypoints.cli.main is the `vllm` console script): its --headless mode is how
    # vLLM documents the other nodes of a multi-node server (a headless multiproc executor for tp/pp
    # ranks, headless engines for data-parallel ranks). The GPU image's CLI; the CPU build's console
    # script does not start (shared/VLLM-CPU.md), which matters only for multi-node, not run locally.
    group_module="vllm.entrypoints.cli.main",
    group_subcommand=("serve",),
    api_key_env="VLLM_API_KEY",
    flags=_vllm_flags,
    health_path="/health",
    metrics_path="/metrics",
    series_prefix="vllm:",
    in_flight_series=("vllm:num_requests_running", "vllm:num_requests_waiting"),
    # Measured on a 2-core CPU machine (shared/VLLM-CPU.md): vLLM's default reservation exceeds its
    # memory; 1 GiB of KV cache and 0.3 of "device" memory fit and are plenty for the demo model.
    cpu_env={"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"},
    cpu_memory_fraction=0.3,
    cpu_ranks_env=_vllm_cpu_ranks_env,
)

BACKEND = VLLM  # what every serving path runs
