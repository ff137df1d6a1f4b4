"""The cluster backend of `supernode job` (issue 36, item 3): a job is a PyTorchJob in its team's
namespace, queued by Kueue, talked to with the official Kubernetes client.

`submit` renders three objects into `team-<team>` (`render`): the job's plan ConfigMap (the plan JSON,
as the stack's own job mounts it), the mesh NetworkPolicy (its pods reach each other, nothing else)
and the PyTorchJob, built by the same functions as the stack's own job (components/k8s/jobs.py) on the
job's plan: Kueue's queue-name label (the namespace's LocalQueue `gpu-<accelerator>`) and the
WorkloadPriorityClass of its priority, labels naming the job, its team and the stack (what `list`
selects on), the plan's sha256 on the pods, a per-job checkpoint directory and run id (the job's
name), and a branch's `--from-run R --step N`. They are applied with server-side apply (PATCH,
application/apply-patch+yaml, field manager `supernode`, force), the PyTorchJob first and the other
two owned by it, so they go with it. A submit is idempotent by name: the PyTorchJob carries the sha256
of everything rendered (`SPEC_SHA`), the same file again sends nothing, and another spec under an
existing name is refused (cancel it first), never silently replacing a running job. `--dry-run DIR`
writes the manifests and contacts nothing.

`list` and `describe` read, per namespace, the PyTorchJobs, Kueue's Workloads and the jobs' pods, and
per LocalQueue Kueue's visibility API (pending workloads, their position in the ClusterQueue); the
step, loss, tokens/s and last checkpoint come from the tail of rank 0's log (`progress_from_log`),
the plan's figures from annotations copied from the plan at submit (never recomputed).

No real API server runs in the tests: tests/kube_api.py is an in-process double of the endpoints
used here that validates every body against the Kubernetes and shipped CRD schemas.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kubernetes.client import rest
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from supernode.components.aws.accelerators import node_labels, node_taints
from supernode.components.aws.storage import CHECKPOINT_DIR, DATASET_DIR
from supernode.components.k8s.common import GpuNodes
from supernode.components.k8s.jobs import (
    CHECKPOINT_PATH,
    JobArgs,
    TrainerArgs,
    mesh_policy_name,
    mesh_policy_spec,
    pytorch_job_spec,
    spans_nodes_over_nvlink,
    trainer_pod_template,
)
from supernode.components.k8s.namespace import PRIORITY_CLASS, PVC_NAME
from supernode.components.k8s.queues import PRIORITY_LABEL, QUEUE_LABEL, job_labels
from supernode.core.config import StackConfig
from supernode.core.errors import BadInput
from supernode.core.jobs import FINAL_STATES, NAME, JobSpec, JobStatus
from supernode.core.observability import TrainerLine
from supernode.core.plan import PLAN_CONFIGMAP_KEY, Plan
from supernode.core.pools import ROLE_LABEL
from supernode.core.runs import RUNS
from supernode.core.teams import NAMESPACE_PREFIX, WORKLOAD_PRIORITY, namespace
from supernode.trainer.node.agent import (
    HEALTH_LABEL,
    INSTANCE_TYPE_LABEL,
    REASON_ANNOTATION,
    UNCHECKED_TAINT,
    UNHEALTHY_TAINT,
)

from .manifests import Manifest
from .manifests import write as write_manifests

# What the client raises when no answer came (refused, reset, timed out): urllib3's, as the kubernetes
# client (which depends on it) imports it.
TRANSPORT_ERRORS = (rest.urllib3.exceptions.HTTPError, OSError)

FIELD_MANAGER = "supernode"
APPLY = "application/apply-patch+yaml"
JOB_LABEL, TEAM_LABEL, STACK_LABEL = "supernode.io/job", "supernode.io/team", "supernode.io/stack"
PART_OF = {"app.kubernetes.io/part-of": "supernode", "app.kubernetes.io/managed-by": "supernode-job"}
PLAN_SHA = "supernode.io/plan-sha256"  # the pods' (components/k8s/jobs.py pod_metadata), also on the job
SPEC_SHA = "supernode.io/spec-sha256"  # everything `render` made: a resubmit compares it
# The plan's figures `list` shows beside the job's own, copied at submit (the job's plan ConfigMap holds them all).
PLAN_STEPS = "supernode.io/plan-steps"
PLAN_TOKENS = "supernode.io/plan-tokens-per-s"
NODE_PRICE = "supernode.io/node-price-per-hour"  # the plan's instance type, on-demand (the catalog's)
GRACE = "supernode.io/termination-grace-s"
PRIORITY = "supernode.io/priority"
# The training operator's pod labels: the job's name and the worker's index.
OPERATOR_JOB = "training.kubeflow.org/job-name"
REPLICA_INDEX = "training.kubeflow.org/replica-index"
CONTAINER = "pytorch"
PYTORCHJOB_API, WORKLOAD_API, VISIBILITY_API = (
    "/apis/kubeflow.org/v1",
    "/apis/kueue.x-k8s.io/v1beta1",
    "/apis/visibility.kueue.x-k8s.io/v1beta1",
)
LOG_TAIL_LINES = 500  # rank 0's progress lines are found in its log's tail
TIMEOUT_S = (5, 60)  # connect, read


def plan_config_map_name(job: str) -> str:
    return f"{job}-plan"


def gpu_nodes(cfg: StackConfig) -> GpuNodes:
    """The GPU nodes as the stack's node groups label and taint them (the stack's own job's selector)."""
    groups = cfg.accelerator_node_groups
    return GpuNodes.for_groups({g.name: node_labels(g) for g in groups}, {g.name: node_taints(g) for g in groups})


def run_id(job: JobSpec) -> str:
    """The job's run: its own training.run, else its name (each job's checkpoints are its own directory)."""
    return job.training.model_dump(exclude_none=True).get("run") or job.name


def render(stack: str, cfg: StackConfig, job: JobSpec, plan: Plan) -> list[Manifest]:
    """The job's objects in its team's namespace, in apply order: plan ConfigMap, mesh NetworkPolicy,
    PyTorchJob (the stack's own job's functions on the job's plan; see the module docstring)."""
    if spans_nodes_over_nvlink(plan):
        raise BadInput(
            f"job {job.name}: its plan spans nodes over NVLink ({plan.instance_type}), which needs a ComputeDomain "
            "per job; submitted jobs do not create one yet (only the stack's own job has it)"
        )
    ns = namespace(job.team)
    labels = {**PART_OF, JOB_LABEL: job.name, TEAM_LABEL: job.team, STACK_LABEL: stack}
    args = TrainerArgs(
        job=JobArgs(
            namespace=ns,
            image=job.image or cfg.images.trainer,
            gpu_nodes=gpu_nodes(cfg),
            plan=plan,
            plan_config_map=plan_config_map_name(job.name),
            priority_class=PRIORITY_CLASS,
        ),
        service_account=cfg.workload.service_account,
        pvc=PVC_NAME,
        data_subpath=DATASET_DIR.strip("/"),
        # One run per out directory (the trainer's lock): each job its own, under its namespace.
        checkpoint_subpath=f"{CHECKPOINT_DIR.strip('/')}/{ns}/{job.name}",
        termination_grace_s=plan.termination_grace_s,
        # queued, as the stack's own job: Kueue may place it on serving's idle share it borrows
        queue_labels=job_labels(plan, WORKLOAD_PRIORITY[job.priority]),
    )
    template = trainer_pod_template(args, job.name)
    template["metadata"]["labels"] = {**template["metadata"]["labels"], JOB_LABEL: job.name, TEAM_LABEL: job.team}
    container = template["spec"]["containers"][0]
    trainer_args = list(container["args"])
    trainer_args[trainer_args.index("--run-id") + 1] = run_id(job)
    if job.branch is not None:
        trainer_args += ["--from-run", job.branch.from_run, "--step", str(job.branch.step)]
        container["volumeMounts"] = [*container["volumeMounts"], parent_run_mount(ns, job.branch.from_run)]
    container["args"] = trainer_args
    plan_json = plan.to_json()
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": plan_config_map_name(job.name), "namespace": ns, "labels": labels},
        "data": {PLAN_CONFIGMAP_KEY: plan_json},
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": mesh_policy_name(job.name), "namespace": ns, "labels": labels},
        "spec": mesh_policy_spec(job.name),
    }
    pytorch_job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {
            "name": job.name,
            "namespace": ns,
            "labels": {**labels, **job_labels(plan, WORKLOAD_PRIORITY[job.priority])},
            "annotations": {
                PLAN_SHA: hashlib.sha256(plan_json.encode()).hexdigest(),
                PRIORITY: job.priority,
                PLAN_STEPS: str(plan.training.steps),
                PLAN_TOKENS: repr(plan.layout.tokens_per_s),
                NODE_PRICE: repr(plan.hardware.price_per_hour),
                GRACE: str(plan.termination_grace_s),
            },
        },
        "spec": pytorch_job_spec(plan, template),
    }
    out = [config_map, policy, pytorch_job]
    pytorch_job["metadata"]["annotations"][SPEC_SHA] = spec_sha(out)
    return out


def parent_run_mount(ns: str, from_run: str) -> dict[str, Any]:
    """A branch's parent run inside the job's out directory, read-only: the trainer finds `--from-run R`
    in OUT/runs/R. R is an earlier job of the same team (whose run is its name, `run_id`), kept in its
    own out directory CHECKPOINT_DIR/<namespace>/R."""
    return {
        "name": "fsx",
        "mountPath": f"{CHECKPOINT_PATH}/{RUNS}/{from_run}",
        "subPath": f"{CHECKPOINT_DIR.strip('/')}/{ns}/{from_run}/{RUNS}/{from_run}",
        "readOnly": True,
    }


def spec_sha(manifests: list[Manifest]) -> str:
    """sha256 of the rendered objects, without the annotation that carries it."""
    bare = json.loads(json.dumps(manifests))
    for m in bare:
        m["metadata"].get("annotations", {}).pop(SPEC_SHA, None)
    return hashlib.sha256(json.dumps(bare, sort_keys=True).encode()).hexdigest()


# -- rank 0's log: where the job is --------------------------------------------------------------
_METRICS = re.compile(r"^" + re.escape(TrainerLine.METRICS) + r"(\{.*\})\s*$")
_CHECKPOINT = re.compile(r"^step (\d+): loss (\S+?)" + re.escape(TrainerLine.CHECKPOINT) + r"(written|started)")
_RESUMED = re.compile(re.escape(TrainerLine.RESUMED) + r" (\d+)")
_STOPPED = re.compile(r"^SIGTERM: stopped after step (\d+) with a checkpoint")


@dataclass
class Progress:
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    last_checkpoint: int | None = None


def _float(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def progress_from_log(lines: list[str]) -> Progress:
    """Step, loss, tokens/s and the newest complete checkpoint from rank 0's lines (trainer/train.py,
    trainer/metrics.py): its periodic metrics line (`TrainerLine.METRICS` + the step's JSON record with
    the checkpoint step) wherever there is one, else the checkpoint, resume and SIGTERM lines. Read
    oldest first, so the newest line wins; a line that does not parse is skipped."""
    p = Progress()
    for line in lines:
        line = line.rstrip("\n")
        if m := _METRICS.match(line):
            try:
                rec = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            if isinstance(rec.get("step"), int):
                p.step, p.loss, p.tokens_per_s = rec["step"], _float(rec.get("loss")), _float(rec.get("tokens_per_s"))
                if isinstance(rec.get("checkpoint_step"), int):
                    p.last_checkpoint = rec["checkpoint_step"]
        elif m := _CHECKPOINT.match(line):
            p.step, p.loss = int(m.group(1)), _float(m.group(2))
            if m.group(3) == "written":
                p.last_checkpoint = int(m.group(1))
        elif m := _RESUMED.search(line):
            p.last_checkpoint = p.step = int(m.group(1))
        elif m := _STOPPED.match(line):
            p.last_checkpoint = int(m.group(1))
    return p


# -- the job's state from its PyTorchJob and Kueue Workload ------------------------------------------
def _ts(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _true(obj: dict | None) -> dict[str, dict]:
    """The conditions of `obj` whose status is True, by type."""
    conds = ((obj or {}).get("status") or {}).get("conditions") or []
    return {c["type"]: c for c in conds if c.get("status") == "True"}


@dataclass
class Observed:
    """What the cluster says about one job: its PyTorchJob, Workload, pods, pending position, log tail."""

    job: dict
    workload: dict | None = None
    pods: list[dict] = field(default_factory=list)
    pending: dict | None = None  # its entry in the visibility API's pending workloads
    log: list[str] | None = None


def job_status(o: Observed, now: float | None = None) -> JobStatus:
    now = time.time() if now is None else now
    md = o.job["metadata"]
    ann, labels = md.get("annotations") or {}, md.get("labels") or {}
    created = _ts(md.get("creationTimestamp")) or now
    jc, wc = _true(o.job), _true(o.workload)
    admitted = wc.get("Admitted")
    admitted_at = _ts(admitted.get("lastTransitionTime")) if admitted else None
    evicted = wc.get("Evicted")
    evicted_at = _ts(evicted.get("lastTransitionTime")) if evicted else None
    running_pods = [p for p in o.pods if (p.get("status") or {}).get("phase") == "Running"]
    stats = ((o.workload or {}).get("status") or {}).get("schedulingStats") or {}
    evictions = stats.get("evictions") or []
    preemptions = sum(int(e.get("count", 0)) for e in evictions if e.get("reason") == "Preempted")
    message = ""
    if md.get("deletionTimestamp"):
        state = "cancelling"
        message = f"cancelled: {len(o.pods)} pod(s) checkpointing before they exit (grace {ann.get(GRACE, '?')} s)"
    elif "Succeeded" in jc:
        state = "succeeded"
    elif "Failed" in jc:
        state, message = "failed", jc["Failed"].get("message", "")
    elif evicted and (admitted or running_pods):
        state = "preempting"
        message = f"evicted by Kueue ({evicted.get('reason', '')}): {evicted.get('message', '')}".rstrip(": ")
    elif admitted or "Running" in jc:
        state = "running"
    else:
        state = "queued"
        if evicted:
            message = f"requeued after eviction ({evicted.get('reason', '')})"
        elif o.workload is None:
            message = "waiting for Kueue to create its Workload"
        else:
            pending = wc.get("QuotaReserved") is None and _false_reason(o.workload, "QuotaReserved")
            message = pending or "waiting for quota"
    since = max(created, evicted_at) if evicted_at and (not admitted_at or evicted_at < admitted_at) else created
    waited = None
    if state == "queued":
        waited = now - since
    elif admitted_at is not None:
        waited = max(0.0, admitted_at - since)
    admission = ((o.workload or {}).get("status") or {}).get("admission") or {}
    held = sum(int(a.get("count", 0)) for a in admission.get("podSetAssignments") or []) if admitted else 0
    nodes = len(running_pods) if state in ("running", "preempting", "cancelling") else 0
    cost = None
    price = _float(ann.get(NODE_PRICE))
    if admitted_at is not None and price is not None:
        end = _ts((o.job.get("status") or {}).get("completionTime")) or now
        cost = (held or nodes) * max(0.0, end - admitted_at) / 3600 * price
    args = _container_args(o.job)
    progress = progress_from_log(o.log) if o.log else Progress()
    parent = None
    if "--from-run" in args and "--step" in args:
        parent = {"run": args[args.index("--from-run") + 1], "step": int(args[args.index("--step") + 1])}
    return JobStatus(
        name=md["name"],
        team=labels.get(TEAM_LABEL) or md.get("namespace", "").removeprefix(NAMESPACE_PREFIX),
        priority=ann.get(PRIORITY) or labels.get(PRIORITY_LABEL, ""),
        state=state,
        backend="cluster",
        submitted_at=created,
        queue_position=(o.pending["positionInClusterQueue"] + 1) if o.pending and state == "queued" else None,
        waited_s=waited,
        nodes=nodes,
        steps=int(ann.get(PLAN_STEPS, 0)),
        step=progress.step,
        loss=progress.loss,
        tokens_per_s=progress.tokens_per_s,
        plan_tokens_per_s=_float(ann.get(PLAN_TOKENS)),
        last_checkpoint=progress.last_checkpoint,
        run=args[args.index("--run-id") + 1] if "--run-id" in args else None,
        parent=parent,
        preemptions=preemptions,
        attempts=sum(int(e.get("count", 0)) for e in evictions) + (1 if admitted or state in ("succeeded",) else 0),
        cost_usd=cost,
        message=message,
    )


def _false_reason(obj: dict, kind: str) -> str:
    for c in ((obj.get("status") or {}).get("conditions")) or []:
        if c.get("type") == kind and c.get("status") == "False" and c.get("message"):
            return c["message"]
    return ""


@dataclass(frozen=True)
class NodeInfo:
    """One Node as the management page's nodes page shows it: what the node agent (supernode.trainer.node.agent)
    wrote on it (its health label and reason annotation, its unchecked / unhealthy taints) and its role."""

    name: str
    instance_type: str
    role: str  # supernode.io/gpu-role (training | serving); "" on a node without one (the system nodes)
    health: str  # the agent's supernode.io/health (ok, quarantined, replacing); "" before its first round
    reason: str  # the agent's finding (supernode.io/health-reason)
    unchecked: bool
    unhealthy: bool
    schedulable: bool  # not cordoned (spec.unschedulable)


def node_info(node: dict) -> NodeInfo:
    md, spec = node.get("metadata") or {}, node.get("spec") or {}
    labels, notes = md.get("labels") or {}, md.get("annotations") or {}
    keys = {t.get("key") for t in spec.get("taints") or []}
    return NodeInfo(
        name=md.get("name", ""),
        instance_type=labels.get(INSTANCE_TYPE_LABEL, ""),
        role=labels.get(ROLE_LABEL, ""),
        health=labels.get(HEALTH_LABEL, ""),
        reason=notes.get(REASON_ANNOTATION, ""),
        unchecked=UNCHECKED_TAINT in keys,
        unhealthy=UNHEALTHY_TAINT in keys,
        schedulable=not spec.get("unschedulable", False),
    )


def _container_args(job: dict) -> list[str]:
    try:
        spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        return list(next(c for c in spec["containers"] if c["name"] == CONTAINER).get("args") or [])
    except (KeyError, StopIteration, TypeError):
        return []


class ClusterBackend:
    """`supernode job` on the stack's cluster (the kubeconfig's context, or --context)."""

    def __init__(
        self,
        stack: str,
        cfg: StackConfig,
        kubeconfig: Path | None = None,
        context: str | None = None,
        in_cluster: bool = False,
    ):
        """`in_cluster`: as the pod's service account (the management page's), not a kubeconfig's user."""
        self.stack, self.cfg, self.kubeconfig, self.context = stack, cfg, kubeconfig, context
        self.in_cluster = in_cluster
        self._client = None

    # -- talking to the API server ----------------------------------------------------------------
    @property
    def client(self):
        if self._client is None and self.in_cluster:
            from kubernetes.client import ApiClient, Configuration
            from kubernetes.config import load_incluster_config

            configuration = Configuration()
            try:
                load_incluster_config(client_configuration=configuration)
            except ConfigException as e:
                raise BadInput(f"no in-cluster service account to talk to the API server with ({e})") from None
            self._client = ApiClient(configuration)
            self._client.configuration.retries = False
        if self._client is None:
            from kubernetes.config import new_client_from_config

            where = f"--kubeconfig {self.kubeconfig}" if self.kubeconfig else "the default kubeconfig (~/.kube/config)"
            try:
                self._client = new_client_from_config(
                    config_file=str(self.kubeconfig) if self.kubeconfig else None, context=self.context
                )
            except (ConfigException, OSError, ValueError, TypeError) as e:
                ctx = f" (context {self.context})" if self.context else ""
                raise BadInput(
                    f"no cluster to talk to: {where}{ctx} is not usable ({e}); give --kubeconfig FILE "
                    "(`aws eks update-kubeconfig --name supernode-<stack>` writes one), or use --local"
                ) from None
            self._client.configuration.retries = False
        return self._client

    def _call(
        self,
        method: str,
        path: str,
        what: str,
        query: list[tuple[str, Any]] | None = None,
        body: Any = None,
        content_type: str | None = None,
        stream: bool = False,
        missing_ok: bool = False,
        absent: tuple[int, ...] = (),
    ) -> Any:
        """One request; every API or connection error is BadInput naming `what` (None instead for a 404
        with `missing_ok`, and for the statuses in `absent`)."""
        client = self.client
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            return client.call_api(
                path,
                method,
                query_params=query or [],
                header_params=headers,
                body=body,
                response_type=None if stream else "object",
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=not stream,
                _request_timeout=None if stream else TIMEOUT_S,
            )
        except ApiException as e:
            if (e.status == 404 and missing_ok) or e.status in absent:
                return None
            raise BadInput(self._api_error(e, what)) from None
        except TRANSPORT_ERRORS as e:
            host = client.configuration.host
            reason = getattr(e, "reason", None) or e
            raise BadInput(
                f"cannot reach the cluster's API server at {host} ({reason}) while {what}; is the cluster up "
                "and the kubeconfig's context the stack's (--kubeconfig, --context)?"
            ) from None

    @staticmethod
    def _api_error(e: ApiException, what: str) -> str:
        try:
            message = json.loads(e.body or "{}").get("message") or e.reason
        except (ValueError, AttributeError):
            message = e.reason
        if e.status == 401:
            return f"{what}: the API server refused the kubeconfig's credentials (401 Unauthorized): {message}"
        if e.status == 403:
            return (
                f"{what}: forbidden (403): {message}. A team's people may read only their own team's namespace; "
                "ask an admin (supernode:admins) or give --team of your own team"
            )
        if e.status == 404:
            return f"{what}: not found (404): {message}"
        return f"{what}: the API server answered {e.status} {e.reason}: {message}"

    def _apply(self, m: Manifest) -> dict:
        md = m["metadata"]
        plural = {"ConfigMap": "configmaps", "NetworkPolicy": "networkpolicies", "PyTorchJob": "pytorchjobs"}[m["kind"]]
        base = {"v1": "/api/v1"}.get(m["apiVersion"], f"/apis/{m['apiVersion']}")
        return self._call(
            "PATCH",
            f"{base}/namespaces/{md['namespace']}/{plural}/{md['name']}",
            f"applying {m['kind']} {md['namespace']}/{md['name']}",
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=m,
            content_type=APPLY,
        )

    # -- reading jobs -----------------------------------------------------------------------------
    def _team_namespaces(self) -> list[str] | None:
        """The stack's team namespaces, where its config names teams; None: find the jobs cluster-wide."""
        teams = self.cfg.teams
        return [namespace(t.name) for t in teams] or None

    def _jobs(self, ns: str | None, selector: str) -> list[dict]:
        where = f"/namespaces/{ns}" if ns else ""
        what = f"listing jobs in namespace {ns}" if ns else "listing jobs in every namespace"
        got = self._call("GET", f"{PYTORCHJOB_API}{where}/pytorchjobs", what, query=[("labelSelector", selector)])
        items = got.get("items") or []
        return [j for j in items if (j["metadata"].get("namespace") or "").startswith(NAMESPACE_PREFIX)]

    def _observe(self, jobs: list[dict], logs: bool) -> list[JobStatus]:
        """Each job's status: per namespace one list of Workloads and one of pods, per LocalQueue one
        list of pending workloads; rank 0's log tail for the jobs that run (or `logs`: all with pods)."""
        by_ns: dict[str, list[dict]] = {}
        for j in jobs:
            by_ns.setdefault(j["metadata"]["namespace"], []).append(j)
        out = []
        for ns, ns_jobs in sorted(by_ns.items()):
            workloads = self._call("GET", f"{WORKLOAD_API}/namespaces/{ns}/workloads", f"listing workloads in {ns}")
            pods = self._call(
                "GET",
                f"/api/v1/namespaces/{ns}/pods",
                f"listing pods in {ns}",
                query=[("labelSelector", JOB_LABEL)],
            )
            pending: dict[tuple[str, str], dict] = {}
            for lq in sorted({(j["metadata"].get("labels") or {}).get(QUEUE_LABEL) for j in ns_jobs} - {None}):
                for w in self._pending(ns, lq):
                    pending[(w["metadata"].get("namespace", ns), w["metadata"]["name"])] = w
            for j in ns_jobs:
                uid = j["metadata"].get("uid")
                wl = next((w for w in workloads.get("items") or [] if _owned_by(w, uid)), None)
                own = [
                    p
                    for p in pods.get("items") or []
                    if (p["metadata"].get("labels") or {}).get(JOB_LABEL) == j["metadata"]["name"]
                ]
                o = Observed(j, wl, own, pending.get((ns, wl["metadata"]["name"])) if wl else None)
                status = job_status(o)
                if own and (logs or status.state in ("running", "preempting", "cancelling")):
                    o.log = self._log_tail(ns, own)
                    status = job_status(o)
                out.append(status)
        return out

    def _pending(self, ns: str, local_queue: str) -> list[dict]:
        """Kueue's pending workloads of a LocalQueue (the visibility API; each with its position in the
        ClusterQueue). The namespaced endpoint, which a team's RoleBinding can grant. Empty where the
        API is not served (404, 503) or not granted (403): the jobs are listed without a position."""
        got = self._call(
            "GET",
            f"{VISIBILITY_API}/namespaces/{ns}/localqueues/{local_queue}/pendingworkloads",
            f"reading the queue of LocalQueue {ns}/{local_queue} (Kueue's visibility API)",
            absent=(403, 404, 503),
        )
        return (got or {}).get("items") or []

    def _rank0(self, pods: list[dict]) -> dict | None:
        """Worker 0: the training operator points the c10d rendezvous at it, and rank 0 runs there."""
        if not pods:
            return None
        return min(
            pods,
            key=lambda p: (int((p["metadata"].get("labels") or {}).get(REPLICA_INDEX, 1 << 30)), p["metadata"]["name"]),
        )

    def _log_tail(self, ns: str, pods: list[dict]) -> list[str] | None:
        pod = self._rank0(pods)
        if pod is None:
            return None
        text = self._call(
            "GET",
            f"/api/v1/namespaces/{ns}/pods/{quote(pod['metadata']['name'])}/log",
            f"reading the log of pod {ns}/{pod['metadata']['name']}",
            query=[("container", CONTAINER), ("tailLines", LOG_TAIL_LINES)],
            missing_ok=True,
        )
        return text.splitlines() if isinstance(text, str) else None

    def _jobs_of_teams(self, selector: str) -> list[dict]:
        """The stack's jobs matching `selector` in every team's namespace: cluster-wide where the config
        names no teams; else each team's, skipping those this user may not read (a team's people see
        their own namespace only), refused only when none may be read."""
        spaces = self._team_namespaces()
        if spaces is None:
            return self._jobs(None, selector)
        jobs, forbidden = [], []
        for ns in spaces:
            try:
                jobs += self._jobs(ns, selector)
            except BadInput as e:
                if "(403)" not in str(e):
                    raise
                forbidden.append(ns)
        if len(forbidden) == len(spaces):
            raise BadInput(
                f"forbidden (403) to list jobs in every team namespace ({', '.join(forbidden)}); give --team"
            )
        return jobs

    def _find(self, name: str, team: str | None) -> dict:
        """The job's PyTorchJob: in --team's namespace, or the one team that has a job of this name."""
        check_names(name, team)
        if team is not None:
            ns = namespace(team)
            job = self._call(
                "GET",
                f"{PYTORCHJOB_API}/namespaces/{ns}/pytorchjobs/{name}",
                f"reading job {name} in {ns}",
                missing_ok=True,
            )
            if job is None or (job["metadata"].get("labels") or {}).get(STACK_LABEL) != self.stack:
                raise BadInput(f"no job {name} in team {team} (namespace {ns}) on stack {self.stack}")
            return job
        selector = f"{JOB_LABEL}={name},{STACK_LABEL}={self.stack}"
        found = self._jobs_of_teams(selector)
        if not found:
            raise BadInput(
                f"no job {name} in any team's namespace on stack {self.stack} (supernode job list shows them)"
            )
        if len(found) > 1:
            teams = sorted(j["metadata"]["namespace"].removeprefix(NAMESPACE_PREFIX) for j in found)
            raise BadInput(f"job {name} is in {len(found)} teams ({', '.join(teams)}): give --team")
        return found[0]

    # -- the API ----------------------------------------------------------------------------------
    def submit(self, job: JobSpec, plan: Plan, dry_run: Path | None = None) -> JobStatus:
        manifests = render(self.stack, self.cfg, job, plan)
        ns = namespace(job.team)
        if dry_run is not None:
            try:
                paths = write_manifests(manifests, dry_run)
            except OSError as e:
                raise BadInput(f"--dry-run {dry_run}: cannot write manifests there ({e.strerror or e})") from None
            return JobStatus(
                name=job.name,
                team=job.team,
                priority=job.priority,
                state="queued",
                backend="cluster",
                submitted_at=time.time(),
                steps=plan.training.steps,
                plan_tokens_per_s=plan.layout.tokens_per_s,
                run=run_id(job),
                parent=job.branch.model_dump() if job.branch else None,
                message=f"dry run: wrote {len(paths)} manifests for {ns} to {dry_run}; nothing was applied",
            )
        pytorch_job = manifests[-1]
        existing = self._call(
            "GET",
            f"{PYTORCHJOB_API}/namespaces/{ns}/pytorchjobs/{job.name}",
            f"reading job {job.name} in {ns}",
            missing_ok=True,
        )
        if existing is not None:
            status = self._observe([existing], logs=False)[0]
            theirs = (existing["metadata"].get("annotations") or {}).get(SPEC_SHA)
            if theirs == pytorch_job["metadata"]["annotations"][SPEC_SHA]:
                status.message = f"already submitted with this spec: nothing applied. {status.message}".strip()
                return status
            raise BadInput(
                f"job {job.name} already exists in {ns} ({status.state}) with another spec (spec sha256 "
                f"{(theirs or 'none')[:12]}, this file's {pytorch_job['metadata']['annotations'][SPEC_SHA][:12]}); "
                f"it is not replaced: cancel it first (supernode job cancel {job.name} --team {job.team} "
                f"--stack {self.stack}) or submit under another name"
            )
        applied = self._apply(pytorch_job)
        owner = {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "name": job.name,
            "uid": applied["metadata"]["uid"],
            "controller": False,
            "blockOwnerDeletion": False,
        }
        try:
            for m in manifests[:-1]:
                self._apply({**m, "metadata": {**m["metadata"], "ownerReferences": [owner]}})
        except BadInput:  # no job without its plan: take it back
            self._call(
                "DELETE",
                f"{PYTORCHJOB_API}/namespaces/{ns}/pytorchjobs/{job.name}",
                f"deleting the half-submitted job {job.name}",
                body={"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"},
                missing_ok=True,
            )
            raise
        status = job_status(Observed(applied))
        status.message = (
            f"submitted to {ns}: LocalQueue {pytorch_job['metadata']['labels'][QUEUE_LABEL]}, "
            f"priority {WORKLOAD_PRIORITY[job.priority]}"
        )
        return status

    def list(self, team: str | None = None) -> list[JobStatus]:
        selector = f"{STACK_LABEL}={self.stack}"
        if team is not None:
            check_names(None, team)
            return self._observe(self._jobs(namespace(team), selector), logs=False)
        return self._observe(self._jobs_of_teams(selector), logs=False)

    def nodes(self) -> list[NodeInfo]:
        """The cluster's Nodes (a cluster-wide `list nodes`), by name."""
        got = self._call("GET", "/api/v1/nodes", "listing the cluster's nodes")
        return sorted((node_info(n) for n in got.get("items") or []), key=lambda n: n.name)

    def describe(self, name: str, team: str | None = None) -> JobStatus:
        return self._observe([self._find(name, team)], logs=True)[0]

    def logs(self, name: str, team: str | None = None, follow: bool = False) -> Iterator[str]:
        """Rank 0's log (worker 0's pod, container `pytorch`); with `follow`, until the pod ends."""
        job = self._find(name, team)
        ns = job["metadata"]["namespace"]
        pods = self._call(
            "GET",
            f"/api/v1/namespaces/{ns}/pods",
            f"listing the pods of job {name}",
            query=[("labelSelector", f"{JOB_LABEL}={name}")],
        )
        pod = self._rank0(pods.get("items") or [])
        if pod is None:
            raise BadInput(f"job {name} in {ns} has no pods yet ({job_status(Observed(job)).state}): no log to show")
        path = f"/api/v1/namespaces/{ns}/pods/{quote(pod['metadata']['name'])}/log"
        query = [("container", CONTAINER), *([("follow", "true")] if follow else [])]
        resp = self._call(
            "GET", path, f"reading the log of pod {ns}/{pod['metadata']['name']}", query=query, stream=True
        )
        try:
            pending = b""
            for chunk in resp.stream(4096, decode_content=True):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", "replace") + "\n"
            if pending:
                yield pending.decode("utf-8", "replace")
        finally:
            resp.release_conn()

    def _delete_job(self, ns: str, name: str, **options) -> Any:
        return self._call(
            "DELETE",
            f"{PYTORCHJOB_API}/namespaces/{ns}/pytorchjobs/{name}",
            f"deleting job {name} in {ns}",
            body={"apiVersion": "v1", "kind": "DeleteOptions", **options},
            missing_ok=True,
        )

    def cancel(self, name: str, team: str | None = None) -> JobStatus:
        """Stop the job for good, letting it checkpoint first. The sequence:

        1. DELETE the PyTorchJob with `propagationPolicy: Foreground` (and the plan's grace period in
           the DeleteOptions): the API server marks it deleted but keeps it until its dependents are
           gone, so `list` shows it `cancelling` while it checkpoints. A job being deleted is no longer
           reconciled by the training operator, which matters: the launcher exits 143 on SIGTERM and,
           under `restartPolicy: ExitCode`, the operator would restart a pod deleted from a live job.
        2. DELETE each of its pods with `gracePeriodSeconds` = the plan's termination grace period
           (workload.terminationGraceS, which the pod template also carries and which the plan proved
           covers a step and a checkpoint write): the kubelet sends SIGTERM to the launcher, torchrun
           forwards it, the trainer finishes its step, writes a checkpoint and exits; SIGKILL comes only
           after the grace period. The garbage collector would delete the pods too, with the same pod
           grace period; deleting them here starts the checkpoint now and pins the grace period to the
           plan's whatever the pod says.
        3. The Kueue Workload, the plan ConfigMap and the NetworkPolicy are the job's dependents and go
           with it; Kueue releases the quota.

        Suspending (runPolicy.suspend, or the Workload's `active: false`) would stop the pods the same
        graceful way but keep the job under its name, queued again; cancel is for good. A job with no
        pods (queued) is simply deleted."""
        job = self._find(name, team)
        ns, md = job["metadata"]["namespace"], job["metadata"]
        grace = int((md.get("annotations") or {}).get(GRACE) or _pod_grace(job))
        if md.get("deletionTimestamp"):
            status = self._observe([job], logs=False)[0]
            status.message = f"already being cancelled. {status.message}".strip()
            return status
        ended = job_status(Observed(job))
        if ended.state in FINAL_STATES:  # nothing runs: nothing to checkpoint
            self._delete_job(ns, name, propagationPolicy="Background")
            ended.message = f"deleted; it had already {ended.state}"
            return ended
        pods = (
            self._call(
                "GET",
                f"/api/v1/namespaces/{ns}/pods",
                f"listing the pods of job {name}",
                query=[("labelSelector", f"{JOB_LABEL}={name}")],
            ).get("items")
            or []
        )
        deleted = self._delete_job(ns, name, propagationPolicy="Foreground", gracePeriodSeconds=grace)
        for pod in pods:
            self._call(
                "DELETE",
                f"/api/v1/namespaces/{ns}/pods/{quote(pod['metadata']['name'])}",
                f"stopping pod {ns}/{pod['metadata']['name']}",
                body={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": grace},
                missing_ok=True,
            )
        status = job_status(
            Observed(deleted if isinstance(deleted, dict) and deleted.get("kind") == "PyTorchJob" else job)
        )
        if pods:
            status.state = "cancelling"
            status.message = (
                f"cancelling: {len(pods)} pod(s) got SIGTERM and have {grace} s (the plan's grace period) to write "
                "their checkpoint; the job is removed once they have exited"
            )
        else:
            status.state, status.nodes = "cancelled", 0
            status.message = "cancelled: it had no pods (nothing to checkpoint); deleted"
        return status


def check_names(name: str | None, team: str | None) -> None:
    """A job or team name as the job file allows it (supernode.core.jobs NAME): it goes into URLs and
    label selectors, so anything else is refused before a request is made."""
    for flag, value in (("NAME", name), ("--team", team)):
        if value is not None and not re.fullmatch(NAME, value):
            raise BadInput(f"{flag} {value!r}: not a job or team name (lowercase letters, digits and '-', at most 40)")


def _owned_by(obj: dict, uid: str | None) -> bool:
    return uid is not None and any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])


def _pod_grace(job: dict) -> int:
    try:
        return int(job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["terminationGracePeriodSeconds"])
    except (KeyError, TypeError, ValueError):
        return 30
