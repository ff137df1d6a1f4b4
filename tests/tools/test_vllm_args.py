"""The serving commands the stacks render, parsed by the pinned vLLM's own argument parser (the serving
environment's: `make serve-env`, or $SUPERNODE_SERVE_PYTHON): a flag it does not know, or a value of the
wrong type, fails here, not on a cluster. Skipped without a serving environment.

One subprocess imports vLLM once (~10 s) and parses every rendered command: the API server's parser
(`vllm.entrypoints.launchers.cli_args.make_arg_parser`, which both `python -m
vllm.entrypoints.openai.api_server` and `vllm serve` build), then the engine's arguments from it
(`AsyncEngineArgs.from_cli_args`), reporting the fields the commands are meant to set.
"""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path

import pytest

from components.k8s.serving import server_spec
from supernode.core.config import load_stack
from supernode.core.errors import BadInput
from supernode.core.plan import build_plan
from supernode.core.serving import BACKEND
from supernode.tools.serve import serve_python

ROOT = Path(__file__).resolve().parents[2]
# What the LeaderWorkerSet webhook sets in a group's pods (a worker's), as the kubelet expands $(VAR).
EXPANDED = {"LWS_LEADER_ADDRESS": "prod-vllm-0.prod-vllm.serving", "LWS_WORKER_INDEX": "1"}

PARSE = r"""
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = []
for argv in json.loads(sys.stdin.read()):
    parser = make_arg_parser(FlexibleArgumentParser())
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        out.append({"error": f"exit {e.code}"})
        continue
    e = AsyncEngineArgs.from_cli_args(args)
    out.append({
        "model": e.model, "tp": e.tensor_parallel_size, "pp": e.pipeline_parallel_size,
        "dp": e.data_parallel_size, "ep": e.enable_expert_parallel, "nnodes": e.nnodes,
        "node_rank": e.node_rank, "master_addr": e.master_addr, "master_port": e.master_port,
        "backend": e.distributed_executor_backend, "max_num_seqs": e.max_num_seqs,
        "headless": args.headless, "ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile,
        "api_key": args.api_key, "port": args.port,
    })
print("RESULT " + json.dumps(out))
"""


def _python() -> Path:
    try:
        return serve_python(ROOT)
    except BadInput as e:
        pytest.skip(f"no serving environment: {e}")


@cache
def _parse(argvs: tuple[tuple[str, ...], ...]) -> list[dict]:
    run = subprocess.run(
        [str(_python()), "-c", PARSE],
        input=json.dumps([list(a) for a in argvs]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def _expanded(argv: list[str]) -> tuple[str, ...]:
    """The args as the kubelet runs them: $(VAR) expanded from the pod's env (the LWS webhook's)."""
    out = []
    for a in argv:
        for var, value in EXPANDED.items():
            a = a.replace(f"$({var})", value)
        out.append(a)
    return tuple(out)


def _rendered() -> dict[str, tuple[str, ...]]:
    prod = build_plan("prod", load_stack("prod", ROOT)).inference
    dev = build_plan("dev", load_stack("dev", ROOT)).inference
    return {
        "prod leader": _expanded(BACKEND.flags(server_spec(prod, "prod-vllm"))),
        "prod worker": _expanded(BACKEND.flags(server_spec(prod, "prod-vllm", rank="$(LWS_WORKER_INDEX)"))),
        "dev": _expanded(BACKEND.flags(server_spec(dev, "dev-vllm"))),
    }


@pytest.mark.slow
def test_the_rendered_commands_parse_with_the_pinned_vllm_and_mean_what_the_plan_says():
    rendered = _rendered()
    bogus = (*rendered["dev"], "--tensor-parallel-degree", "2")  # a flag vLLM does not have
    wrong_type = (*rendered["dev"], "--data-parallel-size", "two")
    leader, worker, dev, bad, bad_type = _parse((*rendered.values(), bogus, wrong_type))
    assert bad == {"error": "exit 2"} and bad_type == {"error": "exit 2"}, (bad, bad_type)

    prod = build_plan("prod", load_stack("prod", ROOT)).inference
    assert prod.layout == "ep" and prod.pods_per_replica == 2
    for parsed in (leader, worker):
        assert "error" not in parsed, parsed
        assert (parsed["tp"], parsed["pp"], parsed["dp"], parsed["ep"]) == (prod.tp, prod.pp, prod.dp, True)
        assert (parsed["nnodes"], parsed["master_addr"], parsed["backend"]) == (2, EXPANDED["LWS_LEADER_ADDRESS"], "mp")
        assert parsed["max_num_seqs"] == prod.max_seqs_per_engine
        assert parsed["ssl_keyfile"].endswith("tls.key") and parsed["ssl_certfile"].endswith("tls.crt")
        assert parsed["api_key"] is None  # the key comes from the env (VLLM_API_KEY), never the command line
    assert (leader["node_rank"], leader["headless"]) == (0, False)
    assert (worker["node_rank"], worker["headless"]) == (int(EXPANDED["LWS_WORKER_INDEX"]), True)
    assert "error" not in dev and (dev["tp"], dev["dp"], dev["ep"], dev["nnodes"], dev["headless"]) == (
        1,
        1,
        False,
        1,
        False,
    )
