"""An in-process double of the Kubernetes API server, for the job API's cluster backend.

No real API server runs in these tests. This is a small HTTP server (http.server in a thread) that
implements only the endpoints supernode.tools.jobs_cluster calls, keeps the objects in memory, and
checks every request the way the API server would before accepting it:

- server-side apply (PATCH): the content type must be application/apply-patch+yaml, a fieldManager
  given, the body's apiVersion, kind, name and namespace those of the URL, and the object valid: built-in
  kinds against the real Kubernetes schemas (kubernetes-validate, strict: unknown fields rejected),
  custom resources against the shipped CRD schemas in components/crds/ with their pod templates as v1
  PodTemplates (supernode.tools.manifests.validate, the preview's own check); an invalid one is
  answered 422 Unprocessable Entity with the problems, as a real server does;
- DELETE: the body must be a valid meta/v1 DeleteOptions; Foreground propagation keeps the object
  (deletionTimestamp, the foregroundDeletion finalizer) until the test calls `finish_deletions`, and a
  pod deleted with a grace period stays Terminating with it;
- GET and LIST (label selectors k=v and k; Nodes, cluster-scoped, by `add_node`), pod logs (container, tailLines), Kueue's Workloads and the
  visibility API's pending workloads of a LocalQueue;
- 401 without the kubeconfig's bearer token, 403 for the namespaces a test forbids, 404 as a Status.

Tests seed what controllers would write (Kueue's Workloads, the operator's pods, their logs) with
`add_workload`, `add_pod` and `set_pending`; those objects are validated against the same schemas.
The client is the real `kubernetes` package, reaching the double through a real kubeconfig file
(`kubeconfig`).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from supernode.tools.manifests import label, validate

CRD_DIR = Path(__file__).resolve().parents[1] / "components" / "crds"
TOKEN = "double-token"
KUBERNETES_VERSION = "1.33"
# plural -> (API prefix, apiVersion, kind) of what the double serves
KINDS = {
    "configmaps": ("/api/v1", "v1", "ConfigMap"),
    "nodes": ("/api/v1", "v1", "Node"),  # cluster-scoped: stored under namespace None
    "pods": ("/api/v1", "v1", "Pod"),
    "networkpolicies": ("/apis/networking.k8s.io/v1", "networking.k8s.io/v1", "NetworkPolicy"),
    "pytorchjobs": ("/apis/kubeflow.org/v1", "kubeflow.org/v1", "PyTorchJob"),
    "workloads": ("/apis/kueue.x-k8s.io/v1beta1", "kueue.x-k8s.io/v1beta1", "Workload"),
}
_PREFIXES = "|".join(sorted({re.escape(p) for p, _, _ in KINDS.values()}, key=len, reverse=True))
_OBJECT = re.compile(
    rf"^(?P<prefix>{_PREFIXES})(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?$"
)
_LOG = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/log$")
_PENDING = re.compile(
    r"^/apis/visibility\.kueue\.x-k8s\.io/v1beta1/namespaces/(?P<ns>[^/]+)/localqueues/(?P<lq>[^/]+)/pendingworkloads$"
)


def _crds() -> list[dict]:
    return [yaml.safe_load(p.read_text(encoding="utf-8")) for p in sorted(CRD_DIR.glob("*.yaml"))]


def problems(obj: dict) -> list[str]:
    """What the API server would reject in `obj` (empty: valid)."""
    return [str(p) for p in validate([*_CRDS, obj], KUBERNETES_VERSION) if p.object == label(obj)]


_CRDS = _crds()


def _delete_options_validator() -> jsonschema.Validator:
    """meta/v1 DeleteOptions, strict, from the schema set kubernetes-validate ships (its own lookup maps
    apiVersion v1 to core/v1, where DeleteOptions has no file)."""
    where = f"kubernetes-json-schema/v{KUBERNETES_VERSION}.0-local-strict"
    schema = schema_contents(f"{where}/deleteoptions-meta-v1.json", KUBERNETES_VERSION)
    defs = schema_contents(f"{where}/_definitions.json", KUBERNETES_VERSION)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


DELETE_OPTIONS = _delete_options_validator()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: Any


@dataclass
class KubeApi:
    # namespaces this user may not read or write ("visibility": Kueue's visibility API, in every namespace)
    forbidden: set[str] = field(default_factory=set)
    forbid_cluster_list: bool = False  # a LIST across all namespaces is 403
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)  # (plural, ns, name)
    logs: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (ns, pod) -> lines
    pending: dict[tuple[str, str], list[dict]] = field(default_factory=dict)  # (ns, LocalQueue)
    seen: list[Seen] = field(default_factory=list)
    rejected: list[tuple[str, list[str]]] = field(default_factory=list)  # (path, problems): each 422 sent

    def __post_init__(self) -> None:
        api = self
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def handle_any(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                ctype = (self.headers.get("Content-Type") or "").split(";")[0]
                body: Any = None
                if raw:
                    try:
                        body = yaml.safe_load(raw) if ctype == "application/apply-patch+yaml" else json.loads(raw)
                    except (yaml.YAMLError, ValueError):
                        self.answer(400, status(400, "BadRequest", "the body is not valid JSON/YAML"))
                        return
                with api.lock:
                    api.seen.append(Seen(self.command, url.path, query, ctype, body))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self.answer(401, status(401, "Unauthorized", "Unauthorized"))
                    return
                with api.lock:
                    code, out = api.route(self.command, url.path, query, ctype, body)
                self.answer(code, out)

            def answer(self, code: int, out: Any) -> None:
                text = out if isinstance(out, str) else json.dumps(out)
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_DELETE = do_POST = do_PUT = handle_any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path, token: str = TOKEN) -> Path:
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "double", "cluster": {"server": self.url}}],
            "users": [{"name": "team-user", "user": {"token": token}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "team-user"}}],
            "current-context": "double",
        }
        path.write_text(yaml.safe_dump(doc), encoding="utf-8")
        return path

    # -- what tests read ---------------------------------------------------------------------------
    def requests(self, method: str | None = None, path: str = "") -> list[Seen]:
        return [s for s in self.seen if (method is None or s.method == method) and path in s.path]

    def get(self, plural: str, ns: str, name: str) -> dict | None:
        return self.objects.get((plural, ns, name))

    # -- what controllers would write ----------------------------------------------------------------
    def _store(self, obj: dict) -> dict:
        bad = problems(obj)
        assert not bad, f"seeded object is invalid: {bad}"
        md = obj["metadata"]
        md.setdefault("uid", str(uuid.uuid4()))
        md.setdefault("creationTimestamp", _now())
        plural = next(p for p, (_, v, k) in KINDS.items() if (v, k) == (obj["apiVersion"], obj["kind"]))
        self.objects[(plural, md.get("namespace"), md["name"])] = obj
        return obj

    def add_node(
        self,
        name: str,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        taints: list[dict] | None = None,
        unschedulable: bool = False,
    ) -> dict:
        """A Node as the kubelet registers it and the node agent labels, annotates and taints it."""
        spec: dict[str, Any] = {"taints": list(taints or [])}
        if unschedulable:
            spec["unschedulable"] = True
        md = {"name": name, "labels": dict(labels or {}), "annotations": dict(annotations or {})}
        return self._store({"apiVersion": "v1", "kind": "Node", "metadata": md, "spec": spec})

    def add_workload(
        self,
        ns: str,
        job: str,
        created: float,
        admitted_at: float | None = None,
        nodes: int = 0,
        evicted: tuple[str, float] | None = None,
        evictions: list[dict] | None = None,
    ) -> dict:
        """The Workload Kueue creates for a PyTorchJob, optionally admitted (or evicted: reason, time)."""
        owner = self.objects[("pytorchjobs", ns, job)]
        conds = []
        if admitted_at is not None:
            conds += [
                {"type": t, "status": "True", "reason": t, "message": "", "lastTransitionTime": stamp(admitted_at)}
                for t in ("QuotaReserved", "Admitted")
            ]
        else:
            conds.append(
                {
                    "type": "QuotaReserved",
                    "status": "False",
                    "reason": "Pending",
                    "message": "couldn't assign flavors to pod set worker: insufficient quota",
                    "lastTransitionTime": stamp(created),
                }
            )
        if evicted is not None:
            conds.append(
                {
                    "type": "Evicted",
                    "status": "True",
                    "reason": evicted[0],
                    "message": "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue",
                    "lastTransitionTime": stamp(evicted[1]),
                }
            )
        status: dict[str, Any] = {"conditions": conds}
        if admitted_at is not None:
            status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [{"name": "worker", "count": nodes}]}
        if evictions:
            status["schedulingStats"] = {"evictions": evictions}
        template = owner["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        return self._store(
            {
                "apiVersion": "kueue.x-k8s.io/v1beta1",
                "kind": "Workload",
                "metadata": {
                    "name": f"pytorchjob-{job}-{uuid.uuid4().hex[:5]}",
                    "namespace": ns,
                    "creationTimestamp": stamp(created),
                    "labels": {"kueue.x-k8s.io/job-uid": owner["metadata"]["uid"]},
                    "ownerReferences": [
                        {
                            "apiVersion": "kubeflow.org/v1",
                            "kind": "PyTorchJob",
                            "name": job,
                            "uid": owner["metadata"]["uid"],
                        }
                    ],
                },
                "spec": {
                    "queueName": owner["metadata"]["labels"]["kueue.x-k8s.io/queue-name"],
                    "podSets": [{"name": "worker", "count": nodes or 1, "template": template}],
                },
                "status": status,
            }
        )

    def add_pod(self, ns: str, job: str, index: int, phase: str = "Running", log: list[str] | None = None) -> dict:
        """A worker pod as the training operator creates it, with its log."""
        owner = self.objects[("pytorchjobs", ns, job)]
        labels = dict(owner["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"])
        labels |= {"training.kubeflow.org/job-name": job, "training.kubeflow.org/replica-index": str(index)}
        name = f"{job}-worker-{index}"
        self.logs[(ns, name)] = list(log or [])
        return self._store(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": ns,
                    "labels": labels,
                    "ownerReferences": [
                        {
                            "apiVersion": "kubeflow.org/v1",
                            "kind": "PyTorchJob",
                            "name": job,
                            "uid": owner["metadata"]["uid"],
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "spec": {"containers": [{"name": "pytorch", "image": "trainer"}], "terminationGracePeriodSeconds": 900},
                "status": {"phase": phase},
            }
        )

    def set_pending(self, ns: str, local_queue: str, workloads: list[tuple[str, int]]) -> None:
        """The visibility API's pending workloads of a LocalQueue: (workload name, position in the ClusterQueue)."""
        self.pending[(ns, local_queue)] = [
            {
                "metadata": {"name": name, "namespace": ns, "creationTimestamp": _now()},
                "localQueueName": local_queue,
                "positionInClusterQueue": pos,
                "positionInLocalQueue": i,
                "priority": 0,
            }
            for i, (name, pos) in enumerate(workloads)
        ]

    def finish_deletions(self) -> None:
        """What the garbage collector and kubelet finish: terminating pods and foreground deletions go."""
        for key, obj in list(self.objects.items()):
            if obj["metadata"].get("deletionTimestamp"):
                del self.objects[key]

    # -- the API -----------------------------------------------------------------------------------
    def route(self, method: str, path: str, query: dict, ctype: str, body: Any) -> tuple[int, Any]:
        if m := _LOG.match(path):
            return self._log(m["ns"], m["name"], query)
        if m := _PENDING.match(path):
            if m["ns"] in self.forbidden or "visibility" in self.forbidden:
                return self._forbidden("list", "pendingworkloads", m["ns"])
            return 200, {
                "kind": "PendingWorkloadsSummary",
                "apiVersion": "visibility.kueue.x-k8s.io/v1beta1",
                "items": self.pending.get((m["ns"], m["lq"]), []),
            }
        m = _OBJECT.match(path)
        if not m or m["plural"] not in KINDS or KINDS[m["plural"]][0] != m["prefix"]:
            return 404, status(404, "NotFound", f"the server could not find the requested resource ({path})")
        plural, ns, name = m["plural"], m["ns"], m["name"]
        if ns in self.forbidden or (ns is None and self.forbid_cluster_list):
            verb = {"GET": "get" if name else "list", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())
            return self._forbidden(verb, plural, ns)
        if method == "PATCH" and name and ns:
            return self._apply(plural, ns, name, query, ctype, body)
        if method == "GET" and name and ns:
            obj = self.objects.get((plural, ns, name))
            return (200, obj) if obj else self._not_found(plural, name)
        if method == "GET" and not name:
            items = [
                o
                for (p, n, _), o in sorted(self.objects.items())
                if p == plural and (ns is None or n == ns) and _selected(o, (query.get("labelSelector") or [""])[0])
            ]
            return 200, {"kind": f"{KINDS[plural][2]}List", "apiVersion": KINDS[plural][1], "items": items}
        if method == "DELETE" and name and ns:
            return self._delete(plural, ns, name, body)
        return 405, status(405, "MethodNotAllowed", f"{method} {path} is not served by the double")

    def _apply(self, plural: str, ns: str, name: str, query: dict, ctype: str, body: Any) -> tuple[int, Any]:
        if ctype != "application/apply-patch+yaml":
            return 415, status(415, "UnsupportedMediaType", f"the double accepts only server-side apply, not {ctype}")
        if not (query.get("fieldManager") or [""])[0]:
            return 422, status(422, "Invalid", "PatchOptions.meta.k8s.io is invalid: fieldManager: Required value")
        _, api_version, kind = KINDS[plural]
        if not isinstance(body, dict) or (body.get("apiVersion"), body.get("kind")) != (api_version, kind):
            return 400, status(400, "BadRequest", f"expected {api_version} {kind} in the body")
        md = body.get("metadata") or {}
        if md.get("name") != name or md.get("namespace", ns) != ns:
            return 400, status(400, "BadRequest", "the name or namespace of the object does not match the URL")
        bad = problems(body)
        if bad:
            self.rejected.append((f"{plural}/{ns}/{name}", bad))
            return 422, status(422, "Invalid", f"{kind} {name!r} is invalid: " + "; ".join(bad))
        old = self.objects.get((plural, ns, name))
        if old is not None and (query.get("force") or [""])[0] != "true":
            return 409, status(409, "Conflict", "Apply failed with 1 conflict: conflict with another manager")
        obj = json.loads(json.dumps(body))
        obj["metadata"]["namespace"] = ns
        kept = {k: v for k, v in (old or {}).get("metadata", {}).items() if k in ("uid", "creationTimestamp")}
        obj["metadata"] |= kept or {"uid": str(uuid.uuid4()), "creationTimestamp": _now()}
        if old and "status" in old:
            obj["status"] = old["status"]
        self.objects[(plural, ns, name)] = obj
        return (200 if old else 201), obj

    def _delete(self, plural: str, ns: str, name: str, body: Any) -> tuple[int, Any]:
        options = dict(body or {"apiVersion": "v1", "kind": "DeleteOptions"})
        bad = [e.message for e in DELETE_OPTIONS.iter_errors(options)]
        if bad:
            self.rejected.append((f"delete {plural}/{ns}/{name}", bad))
            return 422, status(422, "Invalid", f"DeleteOptions is invalid: {'; '.join(bad)}")
        obj = self.objects.get((plural, ns, name))
        if obj is None:
            return self._not_found(plural, name)
        md = obj["metadata"]
        if plural == "pods" and options.get("gracePeriodSeconds", 30) > 0:
            md.setdefault("deletionTimestamp", _now())
            md["deletionGracePeriodSeconds"] = options.get("gracePeriodSeconds", 30)
            return 200, obj
        if options.get("propagationPolicy") == "Foreground":
            md.setdefault("deletionTimestamp", _now())
            md["finalizers"] = sorted({*md.get("finalizers", []), "foregroundDeletion"})
            return 200, obj
        del self.objects[(plural, ns, name)]
        return 200, status(200, "", "deleted", success=True)

    def _log(self, ns: str, name: str, query: dict) -> tuple[int, Any]:
        if ns in self.forbidden:
            return self._forbidden("get", "pods/log", ns)
        pod = self.objects.get(("pods", ns, name))
        if pod is None:
            return self._not_found("pods", name)
        container = (query.get("container") or [None])[0]
        names = [c["name"] for c in pod["spec"]["containers"]]
        if container is not None and container not in names:
            return 400, status(400, "BadRequest", f"container {container} is not valid for pod {name}")
        lines = self.logs.get((ns, name), [])
        tail = (query.get("tailLines") or [None])[0]
        if tail is not None:
            lines = lines[-int(tail) :] if int(tail) else []
        return 200, "".join(line + "\n" for line in lines)

    @staticmethod
    def _not_found(plural: str, name: str) -> tuple[int, Any]:
        return 404, status(404, "NotFound", f'{plural} "{name}" not found')

    @staticmethod
    def _forbidden(verb: str, plural: str, ns: str | None) -> tuple[int, Any]:
        where = f' in the namespace "{ns}"' if ns else " at the cluster scope"
        return 403, status(
            403, "Forbidden", f'{plural} is forbidden: User "team-user" cannot {verb} resource "{plural}"{where}'
        )


def status(code: int, reason: str, message: str, success: bool = False) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if success else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _selected(obj: dict, selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if key not in labels or ("=" in term and labels[key] != value):
            return False
    return True
