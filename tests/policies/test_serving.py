"""The serving workload in the prod preview: its manifests validate, the serving policies pass on it
and fail on the mutations they exist for."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from supernode.core import resource_types as T
from supernode.core.config import load_stack
from supernode.tools.policycheck import check, config_from_stack
from supernode.tools.preview import run_program

ROOT = Path(__file__).resolve().parents[2]
SERVING_POLICIES = {
    "serving-weights-verified",
    "serving-availability",
    "serving-not-public",
    "serving-plan-fits",
    "serving-plan-meets-targets",
}


@pytest.fixture(scope="module")
def prod():
    cfg = load_stack("prod", ROOT)
    result = run_program("prod", cfg)
    return cfg, [r if isinstance(r, dict) else r.to_json() for r in result.resources]


def _find(resources: list[dict], typ: str, component: str = "serving") -> dict:
    return next(
        r
        for r in resources
        if r["type"] == typ
        and ((r["inputs"].get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/component") == component
    )


def _serving_findings(resources: list[dict], cfg) -> dict[str, list[str]]:
    report = check(resources, config_from_stack(cfg))
    out: dict[str, list[str]] = {}
    for v in report.violations:
        if v.policy in SERVING_POLICIES:
            out.setdefault(v.policy, []).append(v.message)
    return out


def test_prod_serving_workload_passes_the_serving_policies(prod):
    """prod serves 16-GPU replicas (dp 2 x tp 8 + ep 16, two nodes): a LeaderWorkerSet of 2 groups of 2."""
    cfg, resources = prod
    lws = _find(resources, T.LEADER_WORKER_SET)
    group = lws["inputs"]["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and lws["inputs"]["spec"]["replicas"] == 2
    for role in ("leaderTemplate", "workerTemplate"):
        spec = group[role]["spec"]
        assert [c["name"] for c in spec["initContainers"]] == ["verify-weights"]
        assert spec["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "8"  # a whole node each
    leader, worker = (group[r]["spec"]["containers"][0] for r in ("leaderTemplate", "workerTemplate"))
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(leader)
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports"} & set(worker)  # headless: no HTTP
    assert _serving_findings(resources, cfg) == {}


def _mutated(resources: list[dict], typ: str, change: Callable[[dict], None]) -> list[dict]:
    out = copy.deepcopy(resources)
    change(_find(out, typ))
    return out


def _drop_init(r: dict) -> None:
    r["inputs"]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"].pop("initContainers")


def _one_replica(r: dict) -> None:
    r["inputs"]["spec"]["replicas"] = 1


def _public_service(r: dict) -> None:
    r["inputs"]["spec"]["type"] = "LoadBalancer"


def _open_ingress(r: dict) -> None:
    r["inputs"]["spec"]["ingress"] = [{"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}]


@pytest.mark.parametrize(
    "typ,change,policy,needle",
    [
        (T.LEADER_WORKER_SET, _drop_init, "serving-weights-verified", "without weights verified by digest"),
        (T.LEADER_WORKER_SET, _one_replica, "serving-availability", "1 replica(s) in prod"),
        (T.K8S_SERVICE, _public_service, "serving-not-public", "LoadBalancer"),
        (T.NETWORK_POLICY, _open_ingress, "serving-not-public", "open to the world"),
    ],
)
def test_serving_policies_fail_on_their_mutation(prod, typ, change, policy, needle):
    cfg, resources = prod
    findings = _serving_findings(_mutated(resources, typ, change), cfg)
    assert policy in findings and any(needle in m for m in findings[policy])


def test_missing_pdb_is_reported(prod):
    cfg, resources = prod
    without = [r for r in resources if r["type"] != T.PDB]
    assert any("no PodDisruptionBudget" in m for m in _serving_findings(without, cfg)["serving-availability"])


def _with_inference(resources: list[dict], cfg, **inference) -> list[dict]:
    """The preview's resources with the plan ConfigMap holding the plan of `cfg` with `inference` changed."""
    from supernode.core.plan import PLAN_CONFIGMAP_KEY, build_plan

    changed = cfg.model_copy(update={"inference": cfg.inference.model_copy(update=inference)})
    plan_json = build_plan("prod", changed).to_json()
    out = copy.deepcopy(resources)
    for r in out:
        if r["type"] == T.CONFIG_MAP and PLAN_CONFIGMAP_KEY in (r["inputs"].get("data") or {}):
            r["inputs"]["data"][PLAN_CONFIGMAP_KEY] = plan_json
    return out


def test_inference_plan_that_does_not_fit_is_reported(prod):
    cfg, resources = prod
    out = _with_inference(resources, cfg, tp=1, pp=1, max_concurrency=64, layout="tp")
    findings = _serving_findings(out, cfg)
    assert any("Fix: use inference.tp 4" in m for m in findings["serving-plan-fits"])


def test_inference_plan_that_misses_its_latency_targets_is_reported(prod):
    """prod's chosen layout meets ttftTargetMs 2000 and itlTargetMs 50; a 1 ms ITL target no layout meets
    is refused, with the estimate and the target named; the TTFT target still met is not named."""
    cfg, resources = prod
    from supernode.core.plan import build_plan

    ip = build_plan("prod", cfg).inference
    assert ip.meets_ttft_target and ip.meets_itl_target  # what the passing test relies on
    findings = _serving_findings(_with_inference(resources, cfg, itl_target_ms=1.0), cfg)
    [message] = findings["serving-plan-meets-targets"]
    assert f"ITL estimate {ip.itl_ms:.1f} ms over the 1 ms target (inference.itlTargetMs)" in message
    assert "TTFT estimate" not in message and "no layout the planner weighed meets them" in message
    # a TTFT target below the estimate: the layouts that meet it (none at this prompt length) are the fix
    tight = ip.ttft_ms * 0.5
    findings = _serving_findings(_with_inference(resources, cfg, ttft_target_ms=tight), cfg)
    [message] = findings["serving-plan-meets-targets"]
    assert f"TTFT estimate {ip.ttft_ms:.1f} ms over the {tight:g} ms target (inference.ttftTargetMs)" in message
    assert "serving-plan-meets-targets" not in _serving_findings(resources, cfg)


def test_verify_script_blocks_a_corrupted_file(tmp_path):
    """The init container's script: copies and verifies; one changed byte stops the pod (exit 1)."""
    from supernode.components.k8s.serving import VERIFY_SCRIPT

    src = tmp_path / "src"
    src.mkdir()
    (src / "model-00001.safetensors").write_bytes(b"weights" * 100)
    import hashlib

    (src / "manifest.json").write_text(
        json.dumps({"files": {"model-00001.safetensors": {"sha256": hashlib.sha256(b"weights" * 100).hexdigest()}}})
    )
    script = tmp_path / "verify.py"
    script.write_text(VERIFY_SCRIPT)
    ok = subprocess.run([sys.executable, str(script), str(src), str(tmp_path / "dst")], capture_output=True, text=True)
    assert ok.returncode == 0 and "1 files verified" in ok.stdout
    (src / "model-00001.safetensors").write_bytes(b"weightz" * 100)
    bad = subprocess.run(
        [sys.executable, str(script), str(src), str(tmp_path / "dst2")], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "model-00001.safetensors sha256" in bad.stderr


@pytest.mark.parametrize("name", ["../escape.safetensors", "/etc/hostname", "sub/x.safetensors", ".."])
def test_verify_script_refuses_a_manifest_entry_outside_its_folder(tmp_path, name):
    """Issue 30 #9, the cluster's copy: the init container joined manifest names to its folders as given."""
    from supernode.components.k8s.serving import VERIFY_SCRIPT

    src = tmp_path / "src"
    src.mkdir()
    (src / "manifest.json").write_text(json.dumps({"files": {name: {"sha256": "0" * 64}}}))
    script = tmp_path / "verify.py"
    script.write_text(VERIFY_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(src), str(tmp_path / "dst")], capture_output=True, text=True)
    assert r.returncode == 1 and f"lists {name!r}, not a plain file name" in r.stderr
    assert not (tmp_path / "escape.safetensors").exists()
