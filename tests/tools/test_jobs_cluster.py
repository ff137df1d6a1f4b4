"""The cluster backend of `supernode job` (supernode.tools.jobs_cluster) against tests/kube_api.py: an
in-process double of the Kubernetes API that validates every request body against the Kubernetes and
shipped CRD schemas (no real API server runs here). The backend reaches it with the real `kubernetes`
client through a real kubeconfig file."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import yaml

from supernode.cli import main
from supernode.core.config import load_stack
from supernode.core.errors import BadInput
from supernode.core.jobs import job_from_mapping, job_plan, read_job
from supernode.core.observability import TrainerLine
from supernode.tools import jobs_cluster as jc
from supernode.tools.jobs_cluster import ClusterBackend, progress_from_log
from supernode.tools.manifests import validate
from tests.kube_api import _CRDS, KubeApi, problems, stamp

ROOT = Path(__file__).resolve().parents[2]
JOB_FILE = ROOT / "jobs" / "moe-lr-sweep.yaml"
NS = "team-research"


@pytest.fixture(scope="module")
def cfg():
    """prod without its teams (and so without its management page, which maps people to teams): the
    backend's cluster-wide path, and jobs of any team name (alpha, beta); prod's own teams are
    tests/tools/test_jobs_prod_teams.py's."""
    prod = load_stack("prod", ROOT)
    return prod.model_copy(update={"teams": [], "management": prod.management.model_copy(update={"ui": None})})


@pytest.fixture
def api():
    a = KubeApi()
    yield a
    a.close()


@pytest.fixture
def backend(api, cfg, tmp_path):
    return ClusterBackend("prod", cfg, kubeconfig=api.kubeconfig(tmp_path / "kubeconfig"))


def job_of(**changes):
    data = yaml.safe_load(JOB_FILE.read_text())
    data.update(changes)
    return job_from_mapping(data)


def planned(cfg, job):
    return job_plan("prod", cfg, job, root=ROOT)


def submitted(backend, cfg, **changes):
    job = job_of(**changes)
    plan = planned(cfg, job)
    return job, plan, backend.submit(job, plan)


def worker_args(obj):
    return obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["args"]


def backdate(api, name, seconds, ns=NS):
    api.objects[("pytorchjobs", ns, name)]["metadata"]["creationTimestamp"] = stamp(time.time() - seconds)


# -- submit ------------------------------------------------------------------------------------------
def test_submit_applies_the_three_objects_server_side_into_the_team_namespace(api, backend, cfg):
    job, plan, status = submitted(backend, cfg)
    patches = api.requests("PATCH")
    assert [p.path.rsplit("/", 2)[-2] for p in patches] == ["pytorchjobs", "configmaps", "networkpolicies"]
    for p in patches:
        assert p.content_type == "application/apply-patch+yaml"
        assert p.query["fieldManager"] == ["supernode"] and p.query["force"] == ["true"]
        assert f"/namespaces/{NS}/" in p.path
    assert api.rejected == []  # the double validated each body against the schemas and accepted it
    pj = api.get("pytorchjobs", NS, "moe-lr-sweep")
    cm = api.get("configmaps", NS, "moe-lr-sweep-plan")
    assert problems(pj) == [] and problems(cm) == []
    labels = pj["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-h100"
    assert labels["kueue.x-k8s.io/priority-class"] == "supernode-experiments"  # priority: low
    assert (labels["supernode.io/job"], labels["supernode.io/team"], labels["supernode.io/stack"]) == (
        "moe-lr-sweep",
        "research",
        "prod",
    )
    # the plan the pods mount is the job's plan, and its hash is on the pods as the stack's job has it
    assert cm["data"]["plan.json"] == plan.to_json()
    sha = hashlib.sha256(plan.to_json().encode()).hexdigest()
    template = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert template["metadata"]["annotations"]["supernode.io/plan-sha256"] == sha
    assert template["spec"]["volumes"][1]["configMap"]["name"] == "moe-lr-sweep-plan"
    assert pj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == plan.nodes == 8
    assert pj["spec"]["elasticPolicy"]["minReplicas"] == 4
    assert template["spec"]["terminationGracePeriodSeconds"] == plan.termination_grace_s
    args = worker_args(pj)
    assert args[args.index("--run-id") + 1] == "moe-lr-sweep" and "--from-run" not in args
    mounts = {m["mountPath"]: m for m in template["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/checkpoints"]["subPath"] == "checkpoints/team-research/moe-lr-sweep"  # its own out dir
    # the plan ConfigMap and the mesh policy belong to the job: they go when it is deleted
    uid = pj["metadata"]["uid"]
    for obj in (cm, api.get("networkpolicies", NS, "allow-mesh-moe-lr-sweep")):
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid]
    assert status.state == "queued" and status.backend == "cluster" and "gpu-h100" in status.message


def test_a_submitted_job_has_the_stack_jobs_pod_but_its_own_names(cfg):
    """The same functions as the stack's own PyTorchJob (the offline preview's): a job file that changes
    nothing gives the stack's pod, except what makes it a job of its own."""
    from supernode.tools.manifests import from_resources
    from supernode.tools.preview import run_program

    stack_job = next(m for m in from_resources(run_program("prod", cfg).resources) if m["kind"] == "PyTorchJob")
    job = job_from_mapping({"name": "same", "team": "research", "priority": "normal"})
    ours = jc.render("prod", cfg, job, planned(cfg, job))[-1]
    theirs_t = stack_job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    ours_t = json.loads(json.dumps(ours["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]))
    assert ours_t["metadata"]["labels"].pop("supernode.io/job") == "same"
    assert ours_t["metadata"]["labels"].pop("supernode.io/team") == "research"
    text = json.dumps(ours_t).replace('"same-plan"', '"supernode-plan"').replace('"same"', '"prod-train"')
    text = text.replace("checkpoints/team-research/same", "checkpoints")
    ours_t = json.loads(text)
    args = ours_t["spec"]["containers"][0]["args"]
    args[args.index("--run-id") + 1] = "prod"
    assert ours_t == theirs_t
    assert {k: v for k, v in ours["spec"].items() if k != "pytorchReplicaSpecs"} == {
        k: v for k, v in stack_job["spec"].items() if k != "pytorchReplicaSpecs"
    }
    assert ours["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "supernode-training"  # normal


def test_a_second_submit_of_the_same_file_sends_nothing(api, backend, cfg):
    submitted(backend, cfg)
    before = len(api.requests("PATCH"))
    job, plan, status = submitted(backend, cfg)
    assert len(api.requests("PATCH")) == before == 3
    assert "already submitted with this spec: nothing applied" in status.message


def test_another_spec_under_a_running_jobs_name_is_refused(api, backend, cfg):
    submitted(backend, cfg)
    api.add_workload(NS, "moe-lr-sweep", created=time.time() - 60, admitted_at=time.time() - 30, nodes=8)
    job = job_of(training={"lr": 0.001})
    with pytest.raises(BadInput, match=r"already exists in team-research \(running\) with another spec") as e:
        backend.submit(job, planned(cfg, job))
    assert "cancel it first (supernode job cancel moe-lr-sweep --team research --stack prod)" in str(e.value)
    assert len(api.requests("PATCH")) == 3  # the first submit's only
    assert worker_args(api.get("pytorchjobs", NS, "moe-lr-sweep")) == worker_args(
        jc.render("prod", backend.cfg, job_of(), planned(cfg, job_of()))[-1]
    )


def test_the_double_rejects_what_a_real_server_would(api, backend, cfg):
    """The submit tests' `rejected == []` means something: an unknown field in the PyTorchJob (its CRD
    schema) or in its pod template (the v1 PodTemplate schema) is a 422, a BadInput naming it."""
    job = job_of()
    pj = jc.render("prod", cfg, job, planned(cfg, job))[-1]
    bad = json.loads(json.dumps(pj))
    bad["spec"]["runPolicy"]["cleanupPolicy"] = "All"
    with pytest.raises(BadInput, match=r"applying PyTorchJob team-research/moe-lr-sweep: .*422.*cleanupPolicy"):
        backend._apply(bad)
    bad = json.loads(json.dumps(pj))
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["cpuLimit"] = "8"
    with pytest.raises(BadInput, match=r"422.*pytorchReplicaSpecs\.Worker\.template\.spec\.containers\.0.*cpuLimit"):
        backend._apply(bad)
    assert len(api.rejected) == 2 and api.get("pytorchjobs", NS, "moe-lr-sweep") is None


def test_dry_run_writes_valid_manifests_and_contacts_nothing(api, cfg, tmp_path):
    job = job_of()
    # a kubeconfig that does not exist: a dry run must not even load one
    backend = ClusterBackend("prod", cfg, kubeconfig=tmp_path / "missing")
    status = backend.submit(job, planned(cfg, job), dry_run=tmp_path / "out")
    files = sorted((tmp_path / "out").glob("*.yaml"))
    assert [f.name for f in files] == [
        "000-configmap-team-research-moe-lr-sweep-plan.yaml",
        "001-networkpolicy-team-research-allow-mesh-moe-lr-sweep.yaml",
        "002-pytorchjob-team-research-moe-lr-sweep.yaml",
    ]
    written = [yaml.safe_load(f.read_text()) for f in files]
    assert written == jc.render("prod", cfg, job, planned(cfg, job))
    assert [str(p) for p in validate([*_CRDS, *written], "1.33") if "CustomResourceDefinition" not in p.object] == []
    assert api.seen == [] and "nothing was applied" in status.message


def test_branching_passes_from_run_and_step_to_the_trainer(api, backend, cfg):
    job, plan, _ = submitted(backend, cfg, name="lr-branch", branch={"fromRun": "moe-lr-sweep", "step": 1200})
    args = worker_args(api.get("pytorchjobs", NS, "lr-branch"))
    assert args[args.index("--run-id") + 1] == "lr-branch"
    assert args[args.index("--from-run") + 1 :][:3] == ["moe-lr-sweep", "--step", "1200"]
    # the parent job's run, read-only, where the trainer looks for --from-run: OUT/runs/<run>
    mounts = api.get("pytorchjobs", NS, "lr-branch")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in mounts["containers"][0]["volumeMounts"]}
    assert mounts["/checkpoints"]["subPath"] == "checkpoints/team-research/lr-branch"
    assert mounts["/checkpoints/runs/moe-lr-sweep"] == {
        "name": "fsx",
        "mountPath": "/checkpoints/runs/moe-lr-sweep",
        "subPath": "checkpoints/team-research/moe-lr-sweep/runs/moe-lr-sweep",
        "readOnly": True,
    }
    assert api.rejected == []
    s = backend.describe("lr-branch")
    assert (s.run, s.parent) == ("lr-branch", {"run": "moe-lr-sweep", "step": 1200})


# -- list and describe -------------------------------------------------------------------------------
def metrics_line(step, loss, tps, ckpt):
    return TrainerLine.METRICS + json.dumps({"step": step, "loss": loss, "tokens_per_s": tps, "checkpoint_step": ckpt})


def test_list_shows_a_queued_job_with_its_position_and_wait_and_a_running_one_with_its_progress(api, backend, cfg):
    _, plan_q, _ = submitted(backend, cfg)  # queued
    _, plan_r, _ = submitted(backend, cfg, name="big-run", priority="high")  # running
    now = time.time()
    backdate(api, "moe-lr-sweep", 120)
    wq = api.add_workload(NS, "moe-lr-sweep", created=now - 120)
    api.set_pending(NS, "gpu-h100", [("someone-elses", 0), (wq["metadata"]["name"], 1)])
    backdate(api, "big-run", 600)
    api.add_workload(NS, "big-run", created=now - 600, admitted_at=now - 540, nodes=8)
    log = [
        "resumed from checkpoint at step 400; training to step 100000 on 64 cuda rank(s)",
        metrics_line(450, 2.5, 1.0e5, 400),
        "step 500: loss 2.4000; checkpoint written, training blocked 120 ms",
        metrics_line(512, 2.3456, 2.1e5, 500),
    ]
    api.add_pod(NS, "big-run", 1, log=["(rank 1 prints nothing)"])
    api.add_pod(NS, "big-run", 0, log=log)
    for i in range(2, 8):
        api.add_pod(NS, "big-run", i)
    api.add_pod(NS, "big-run", 8, phase="Pending")

    seen = len(api.seen)
    statuses = {s.name: s for s in backend.list()}
    q, r = statuses["moe-lr-sweep"], statuses["big-run"]
    assert (q.state, q.queue_position, q.nodes, q.priority) == ("queued", 2, 0, "low")
    assert 118 <= q.waited_s <= 130 and "insufficient quota" in q.message
    assert q.cost_usd is None and q.steps == plan_q.training.steps
    assert (r.state, r.queue_position, r.nodes, r.priority) == ("running", None, 8, "high")
    assert 58 <= r.waited_s <= 62  # created -> admitted
    assert (r.step, r.loss, r.tokens_per_s, r.last_checkpoint) == (512, 2.3456, 2.1e5, 500)
    assert r.plan_tokens_per_s == plan_r.layout.tokens_per_s
    expected = 8 * (540 / 3600) * plan_r.hardware.price_per_hour
    assert r.cost_usd == pytest.approx(expected, rel=0.02)
    assert r.attempts == 1 and r.preemptions == 0
    # the LocalQueue's pending list came from Kueue's visibility API, and the log from worker 0's tail
    assert api.requests("GET", f"/namespaces/{NS}/localqueues/gpu-h100/pendingworkloads")
    logs = api.requests("GET", "/log")
    assert [s.path.rsplit("/", 2)[-2] for s in logs] == ["big-run-worker-0"]
    assert logs[0].query["tailLines"] == [str(jc.LOG_TAIL_LINES)] and logs[0].query["container"] == ["pytorch"]
    # the stack's jobs, selected by its label (the stack config names no teams: across namespaces)
    lists = [s for s in api.seen[seen:] if s.path.endswith("/pytorchjobs")]
    assert [(s.path, s.query["labelSelector"]) for s in lists] == [
        ("/apis/kubeflow.org/v1/pytorchjobs", ["supernode.io/stack=prod"])
    ]

    d = backend.describe("big-run")
    assert (d.state, d.step, d.nodes, d.team) == ("running", 512, 8, "research")


def test_a_preempted_job_is_preempting_then_queued_again_with_its_preemption_counted(api, backend, cfg):
    submitted(backend, cfg)
    now = time.time()
    backdate(api, "moe-lr-sweep", 300)
    evictions = [{"reason": "Preempted", "underlyingCause": "", "count": 1}]
    api.add_workload(
        NS,
        "moe-lr-sweep",
        created=now - 300,
        admitted_at=now - 200,
        nodes=8,
        evicted=("Preempted", now - 5),
        evictions=evictions,
    )
    api.add_pod(NS, "moe-lr-sweep", 0)
    s = backend.describe("moe-lr-sweep", team="research")
    assert s.state == "preempting" and "Preempted" in s.message and s.preemptions == 1
    # the eviction done: quota released, the job waits again, its wait counted from the eviction
    api.objects = {k: v for k, v in api.objects.items() if k[0] not in ("workloads", "pods")}
    api.add_workload(NS, "moe-lr-sweep", created=now - 300, evicted=("Preempted", now - 5), evictions=evictions)
    s = backend.describe("moe-lr-sweep", team="research")
    assert s.state == "queued" and s.preemptions == 1 and s.attempts == 1 and 4 <= s.waited_s <= 10


def test_progress_from_the_trainers_own_metrics_line(monkeypatch, tmp_path, cfg):
    """The line the trainer prints (trainer/metrics.py) is the line the backend reads."""
    import logging

    from supernode.core import observability as obs
    from supernode.core.plan import build_plan
    from supernode.trainer.log import LOG
    from supernode.trainer.metrics import Metrics

    monkeypatch.setattr(obs, "METRICS_LINE_EVERY_S", 0.0)
    lines: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    grab = Grab()
    LOG.addHandler(grab)
    LOG.setLevel(logging.INFO)
    try:
        m = Metrics(tmp_path, build_plan("prod", cfg), 64, "cpu")
        m.log(
            7,
            loss=3.25,
            lr=1e-4,
            grad_norm=1.0,
            tokens=4096,
            step_s=2.0,
            compute_s=1.5,
            comm_s=0.3,
            data_s=0.2,
            expert_load=None,
        )
        m.close()
    finally:
        LOG.removeHandler(grab)
    assert any(line.startswith(TrainerLine.METRICS) for line in lines)
    p = progress_from_log(lines)
    assert (p.step, p.loss, p.tokens_per_s, p.last_checkpoint) == (7, 3.25, 2048.0, None)


def test_progress_from_checkpoint_and_sigterm_lines_without_a_metrics_line():
    p = progress_from_log(
        [
            "step 40: loss 3.1000; checkpoint started (async), training blocked 20 ms",
            "step 80: loss 2.9000; checkpoint written, training blocked 900 ms",
            "SIGTERM: stopped after step 81 with a checkpoint; run again to resume",
            "metrics {not json",
        ]
    )
    assert (p.step, p.loss, p.tokens_per_s, p.last_checkpoint) == (80, 2.9, None, 81)


# -- logs and cancel ---------------------------------------------------------------------------------
def test_logs_are_rank_0s(api, backend, cfg):
    submitted(backend, cfg)
    api.add_workload(NS, "moe-lr-sweep", created=time.time() - 60, admitted_at=time.time() - 30, nodes=8)
    api.add_pod(NS, "moe-lr-sweep", 1, log=["worker one"])
    api.add_pod(NS, "moe-lr-sweep", 0, log=["starting at step 0; training to step 100000", "step 1: loss 9.0000"])
    assert list(backend.logs("moe-lr-sweep")) == [
        "starting at step 0; training to step 100000\n",
        "step 1: loss 9.0000\n",
    ]
    list(backend.logs("moe-lr-sweep", team="research", follow=True))
    last = api.requests("GET", "/log")[-1]
    assert last.path.endswith("/pods/moe-lr-sweep-worker-0/log") and last.query["follow"] == ["true"]


def test_logs_of_a_job_without_pods_say_so(api, backend, cfg):
    submitted(backend, cfg)
    with pytest.raises(BadInput, match=r"job moe-lr-sweep in team-research has no pods yet \(queued\)"):
        list(backend.logs("moe-lr-sweep"))


def test_cancel_deletes_the_job_in_the_foreground_then_its_pods_with_the_plans_grace(api, backend, cfg):
    _, plan, _ = submitted(backend, cfg)
    api.add_workload(NS, "moe-lr-sweep", created=time.time() - 60, admitted_at=time.time() - 30, nodes=8)
    for i in range(8):
        api.add_pod(NS, "moe-lr-sweep", i)
    s = backend.cancel("moe-lr-sweep")
    deletes = api.requests("DELETE")
    assert deletes[0].path.endswith(f"/namespaces/{NS}/pytorchjobs/moe-lr-sweep")  # the job first: no restarts
    assert deletes[0].body["propagationPolicy"] == "Foreground"
    assert deletes[0].body["gracePeriodSeconds"] == plan.termination_grace_s == 900
    pods = deletes[1:]
    assert len(pods) == 8 and all(d.body["gracePeriodSeconds"] == plan.termination_grace_s for d in pods)
    assert api.rejected == []  # valid DeleteOptions
    assert s.state == "cancelling" and "900 s" in s.message and "checkpoint" in s.message
    # while its pods checkpoint the job is still there, cancelling; once they are gone, so is it
    assert backend.describe("moe-lr-sweep").state == "cancelling"
    assert "already being cancelled" in backend.cancel("moe-lr-sweep").message
    api.finish_deletions()
    with pytest.raises(BadInput, match="no job moe-lr-sweep in any team's namespace on stack prod"):
        backend.describe("moe-lr-sweep")


def test_cancel_of_a_queued_job_deletes_it_at_once(api, backend, cfg):
    submitted(backend, cfg)
    s = backend.cancel("moe-lr-sweep", team="research")
    assert s.state == "cancelled" and len(api.requests("DELETE")) == 1


def test_cancel_of_a_finished_job_just_deletes_it(api, backend, cfg):
    submitted(backend, cfg)
    pj = api.get("pytorchjobs", NS, "moe-lr-sweep")
    pj["status"] = {"conditions": [{"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"}]}
    api.add_pod(NS, "moe-lr-sweep", 0, phase="Succeeded")
    s = backend.cancel("moe-lr-sweep")
    [delete] = api.requests("DELETE")
    assert delete.body["propagationPolicy"] == "Background" and s.message == "deleted; it had already succeeded"
    assert api.get("pytorchjobs", NS, "moe-lr-sweep") is None


def test_without_the_visibility_api_jobs_are_listed_without_a_position(api, backend, cfg):
    submitted(backend, cfg)
    api.add_workload(NS, "moe-lr-sweep", created=time.time() - 10)
    api.forbidden.add("visibility")  # the double's switch: pendingworkloads answers 403
    [s] = backend.list(team="research")
    assert s.state == "queued" and s.queue_position is None and s.waited_s is not None


# -- errors ------------------------------------------------------------------------------------------
def test_forbidden_namespace_is_a_clear_message(api, backend):
    api.forbidden.add(NS)
    with pytest.raises(BadInput, match=r"reading job x in team-research: forbidden \(403\).*team-research"):
        backend.describe("x", team="research")
    with pytest.raises(BadInput, match=r"listing jobs in namespace team-research: forbidden \(403\)"):
        backend.list(team="research")
    api.forbid_cluster_list = True
    with pytest.raises(BadInput, match=r"listing jobs in every namespace: forbidden \(403\).*give --team"):
        backend.list()


def test_not_found_and_a_name_in_two_teams(api, backend, cfg):
    with pytest.raises(BadInput, match=r"no job nope in team research \(namespace team-research\) on stack prod"):
        backend.describe("nope", team="research")
    with pytest.raises(BadInput, match="no job nope in any team's namespace on stack prod"):
        backend.cancel("nope")
    submitted(backend, cfg, team="alpha")
    submitted(backend, cfg, team="beta")
    with pytest.raises(BadInput, match=r"job moe-lr-sweep is in 2 teams \(alpha, beta\): give --team"):
        backend.describe("moe-lr-sweep")
    assert backend.describe("moe-lr-sweep", team="beta").team == "beta"


def test_with_teams_in_the_config_each_teams_namespace_is_read_and_forbidden_ones_skipped(api, backend, cfg):
    submitted(backend, cfg, team="alpha")
    submitted(backend, cfg, team="beta", name="other")
    backend._team_namespaces = lambda: ["team-alpha", "team-beta"]
    api.forbidden.add("team-beta")  # a member of alpha
    assert [(s.team, s.name) for s in backend.list()] == [("alpha", "moe-lr-sweep")]
    assert backend.describe("moe-lr-sweep").team == "alpha"
    assert not [s for s in api.seen if s.path == "/apis/kubeflow.org/v1/pytorchjobs"]  # never cluster-wide
    api.forbidden.add("team-alpha")
    with pytest.raises(
        BadInput, match=r"forbidden \(403\) to list jobs in every team namespace \(team-alpha, team-beta\)"
    ):
        backend.list()


def test_names_that_are_not_job_names_are_refused_before_any_request(api, backend):
    for name, team in (("../../api/v1/secrets", None), ("ok", "a,b"), ("UPPER", "research")):
        with pytest.raises(BadInput, match="not a job or team name"):
            backend.describe(name, team=team)
    with pytest.raises(BadInput, match="--team 'x/y'"):
        backend.list(team="x/y")
    assert api.seen == []


def test_no_cluster_reachable(cfg, tmp_path):
    dead = KubeApi()
    kubeconfig = dead.kubeconfig(tmp_path / "kubeconfig")
    dead.close()
    backend = ClusterBackend("prod", cfg, kubeconfig=kubeconfig)
    with pytest.raises(BadInput, match=r"cannot reach the cluster's API server at http://127\.0\.0\.1:\d+"):
        backend.list()
    with pytest.raises(BadInput, match=r"no cluster to talk to: --kubeconfig .*missing is not usable"):
        ClusterBackend("prod", cfg, kubeconfig=tmp_path / "missing").list()


def test_wrong_credentials(api, cfg, tmp_path):
    backend = ClusterBackend("prod", cfg, kubeconfig=api.kubeconfig(tmp_path / "kc", token="stale"))
    with pytest.raises(BadInput, match=r"refused the kubeconfig's credentials \(401"):
        backend.list(team="research")


# -- the CLI end to end ------------------------------------------------------------------------------
def test_cli_submit_list_describe_logs_cancel(api, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the table's columns, unwrapped
    kc = str(api.kubeconfig(tmp_path / "kubeconfig"))
    common = ["--stack", "prod", "--root", str(ROOT), "--kubeconfig", kc]
    assert main(["job", "submit", str(JOB_FILE), *common, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "queued"
    assert main(["job", "submit", str(JOB_FILE), *common]) == 0
    assert "nothing applied" in capsys.readouterr().out
    api.add_workload(NS, "moe-lr-sweep", created=time.time() - 60, admitted_at=time.time() - 30, nodes=8)
    api.add_pod(NS, "moe-lr-sweep", 0, log=[metrics_line(12, 4.5, 1.5e5, None)])
    assert main(["job", "list", *common, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["name"], row["state"], row["step"], row["nodes"]) == ("moe-lr-sweep", "running", 12, 1)
    assert main(["job", "list", *common]) == 0
    table = capsys.readouterr().out
    assert "moe-lr-sweep" in table and "running" in table and "12/100000" in table
    assert main(["job", "describe", "moe-lr-sweep", *common]) == 0
    out = capsys.readouterr().out
    assert "state      running" in out and "step       12 of 100000, loss 4.5000" in out
    assert main(["job", "logs", "moe-lr-sweep", *common]) == 0
    assert capsys.readouterr().out.startswith(TrainerLine.METRICS)
    assert main(["job", "cancel", "moe-lr-sweep", *common, "--team", "research"]) == 0
    assert "cancelling" in capsys.readouterr().out
    assert main(["job", "submit", str(JOB_FILE), *common, "--dry-run", str(tmp_path / "dry")]) == 0
    assert len(list((tmp_path / "dry").glob("*.yaml"))) == 3


def test_cli_errors_are_messages_not_tracebacks(api, tmp_path, capsys):
    kc = str(api.kubeconfig(tmp_path / "kubeconfig"))
    api.forbidden.add(NS)
    assert (
        main(["job", "describe", "x", "--team", "research", "--stack", "prod", "--root", str(ROOT), "--kubeconfig", kc])
        == 2
    )
    err = capsys.readouterr().err
    assert "forbidden (403)" in err and "Traceback" not in err and "internal error" not in err


def test_the_job_file_reads_as_the_tests_build_it():
    assert read_job(JOB_FILE) == job_of()
