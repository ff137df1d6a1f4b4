"""Pod templates embedded in other objects are validated as strictly as a Pod: the LeaderWorkerSet's
leader and worker templates (its CRD leaves them open, so supernode/tools/manifests.py checks them as
v1 PodTemplates) and a CronJob's jobTemplate (a built-in kind: its own schema reaches the pod)."""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path

from supernode.core.config import from_mapping, load_stack
from supernode.tools import manifests as mf
from supernode.tools.preview import run_program

ROOT = Path(__file__).resolve().parents[2]


@cache
def multinode_serving() -> tuple[str, list[dict]]:
    """The dev stack serving a replica of tp 8 x pp 2 (16 GPUs: two p5 nodes): a LeaderWorkerSet."""
    data = load_stack("dev", ROOT).to_mapping()
    data["inference"].update(tp=8, pp=2)
    cfg = from_mapping(data)
    return cfg.cluster.kubernetes_version, mf.from_resources(run_program("dev", cfg).resources)


def _one(manifests: list[dict], kind: str, name_part: str = "") -> dict:
    return next(m for m in manifests if m["kind"] == kind and name_part in m["metadata"]["name"])


def test_the_leaderworkerset_templates_validate_as_pod_templates():
    version, manifests = multinode_serving()
    lws = _one(manifests, "LeaderWorkerSet")
    templates = dict(mf.EMBEDDED_POD_TEMPLATES["leaderworkerset.x-k8s.io/LeaderWorkerSet"](lws))
    assert set(templates) == {"spec.leaderWorkerTemplate.leaderTemplate", "spec.leaderWorkerTemplate.workerTemplate"}
    assert all(t["spec"]["containers"] for t in templates.values())
    assert mf.validate(manifests, version) == []


def test_a_bad_field_inside_a_leaderworkerset_template_is_reported_with_its_path():
    version, manifests = multinode_serving()
    manifests = copy.deepcopy(manifests)
    lwt = _one(manifests, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    lwt["workerTemplate"]["spec"]["containers"][0]["imagePullPolice"] = "Always"  # misspelt: unknown field
    lwt["leaderTemplate"]["spec"]["containers"][0]["resources"]["limits"] = "8 GPUs"  # wrong type
    problems = [str(p) for p in mf.validate(manifests, version)]
    assert len(problems) == 2, problems
    assert any(
        "spec.leaderWorkerTemplate.workerTemplate.spec.containers.0" in p and "imagePullPolice" in p for p in problems
    )
    assert any("spec.leaderWorkerTemplate.leaderTemplate.spec.containers.0.resources.limits" in p for p in problems)
    assert all(p.startswith("LeaderWorkerSet ") for p in problems)


def test_a_bad_field_inside_a_cronjobs_pod_template_is_reported_by_the_builtin_schema():
    version, manifests = multinode_serving()
    manifests = copy.deepcopy(manifests)
    cron = next(m for m in manifests if m["kind"] == "CronJob")
    cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    problems = [str(p) for p in mf.validate(manifests, version)]
    assert len(problems) == 1 and problems[0].startswith("CronJob "), problems
    assert "spec.jobTemplate.spec.template.spec.containers.0" in problems[0] and "imagePullPolice" in problems[0]
