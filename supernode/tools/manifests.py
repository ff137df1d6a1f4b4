"""Kubernetes manifests from an offline preview, and their validation.

The recorded inputs of `kubernetes:*` resources are the objects Pulumi would send to the API
server (camelCase fields). Built-in kinds are validated with `kubernetes-validate` in strict mode
(unknown fields are errors) against the schema set closest to, and not newer than, the cluster's
Kubernetes version; custom resources against the `openAPIV3Schema` of their CRD in the same set,
closed the way the API server's strict field validation closes it, with embedded pod templates
checked as v1 PodTemplates.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError, VersionNotSupportedError, all_versions
from kubernetes_validate.utils import validate as validate_builtin
from packaging.version import Version

from ..core.errors import BadInput

Manifest = dict[str, Any]


def _native(value: Any) -> Any:
    """The engine carries numbers as doubles (protobuf Struct): give integral ones back as ints.
    Keys are sorted because the engine's maps are unordered and written manifests should diff cleanly."""
    if isinstance(value, dict):
        return {k: _native(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_native(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# kubectl-apply order: what others refer to first; kinds not listed (custom resources) last.
APPLY_ORDER = (
    "Namespace",
    "CustomResourceDefinition",
    "PriorityClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "ResourceQuota",
    "LimitRange",
    "NetworkPolicy",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Service",
    "DaemonSet",
    "Deployment",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
    "Job",
)


def _apply_key(m: Manifest) -> tuple:
    kind, md = m["kind"], m.get("metadata", {})
    rank = APPLY_ORDER.index(kind) if kind in APPLY_ORDER else len(APPLY_ORDER)
    return rank, kind, md.get("namespace", ""), md.get("name", "")


def from_resources(resources: Iterable[Any]) -> list[Manifest]:
    """Every Kubernetes object among recorded preview resources (`supernode.tools.preview.Resource`), in
    apply order, with apiVersion / kind / metadata first as kubectl prints them."""
    out = []
    for r in resources:
        obj = r.inputs
        if not (r.type.startswith("kubernetes:") and r.custom and "apiVersion" in obj and "kind" in obj):
            continue
        head = {k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}
        body = _native(obj)
        out.append({**{k: body[k] for k in head}, **{k: v for k, v in body.items() if k not in head}})
    return sorted(out, key=_apply_key)


def label(m: Manifest) -> str:
    md = m.get("metadata", {})
    ns = f"{md['namespace']}/" if md.get("namespace") else ""
    return f"{m['kind']} {ns}{md.get('name', '?')}"


def write(manifests: list[Manifest], out_dir: Path) -> list[Path]:
    """One YAML file per object, numbered in apply order (`kubectl apply -f DIR` applies them sorted).
    Numbered files of an earlier run are removed first, so the directory is exactly this preview."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("[0-9][0-9][0-9]-*.yaml"):
        old.unlink()
    paths = []
    for i, m in enumerate(manifests):
        md = m.get("metadata", {})
        stem = "-".join(p for p in (m["kind"].lower(), md.get("namespace", ""), md.get("name", "")) if p)
        path = out_dir / f"{i:03d}-{re.sub(r'[^a-z0-9.-]+', '-', stem.lower())}.yaml"
        path.write_text(yaml.safe_dump(m, sort_keys=False, default_flow_style=False), encoding="utf-8")
        paths.append(path)
    return paths


def schema_version(kubernetes_version: str) -> str:
    """The newest schema set kubernetes-validate ships that is not newer than the cluster (major.minor)."""
    want = Version(kubernetes_version)
    shipped = [Version(v) for v in all_versions()]
    usable = [v for v in shipped if (v.major, v.minor) <= (want.major, want.minor)]
    if not usable:
        raise VersionNotSupportedError(kubernetes_version)
    best = max(usable)
    return f"{best.major}.{best.minor}"


@dataclass(frozen=True)
class Problem:
    object: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.object}: {self.path or '(root)'}: {self.message}"


def _closed(schema: Any) -> Any:
    """An OpenAPI v3 CRD schema with unknown fields rejected: objects that list `properties` and
    neither `additionalProperties` nor `x-kubernetes-preserve-unknown-fields` get
    `additionalProperties: false` (what `kubectl apply --validate=strict` enforces)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _pytorchjob_templates(m: Manifest) -> Iterator[tuple[str, Any]]:
    for role, replica in (m.get("spec", {}).get("pytorchReplicaSpecs") or {}).items():
        yield f"spec.pytorchReplicaSpecs.{role}.template", replica.get("template", {})


def _leaderworkerset_templates(m: Manifest) -> Iterator[tuple[str, Any]]:
    lwt = m.get("spec", {}).get("leaderWorkerTemplate") or {}
    for role in ("leaderTemplate", "workerTemplate"):
        if role in lwt:
            yield f"spec.leaderWorkerTemplate.{role}", lwt[role]


# Pod templates inside custom resources whose CRD schema leaves them open (validated as PodTemplate).
# Built-in kinds (Deployment, DaemonSet, Job, CronJob's jobTemplate) need none: their schemas include
# the pod template, checked strictly. The other CRDs we ship (Kueue, ComputeDomain) embed no pod.
EMBEDDED_POD_TEMPLATES: dict[str, Callable[[Manifest], Iterator[tuple[str, Any]]]] = {
    "kubeflow.org/PyTorchJob": _pytorchjob_templates,
    "leaderworkerset.x-k8s.io/LeaderWorkerSet": _leaderworkerset_templates,
}


def _group(api_version: str) -> str:
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def _crd_schemas(manifests: list[Manifest]) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) → openAPIV3Schema, from the CRDs among the manifests."""
    out = {}
    for m in manifests:
        if m["kind"] == "CustomResourceDefinition":
            spec = m["spec"]
            for v in spec.get("versions", []):
                out[(f"{spec['group']}/{v['name']}", spec["names"]["kind"])] = v["schema"]["openAPIV3Schema"]
    return out


def _builtin(m: Manifest, version: str, name: str) -> list[Problem]:
    try:
        validate_builtin(m, version, strict=True)
    except ValidationError as e:
        return [Problem(name, ".".join(map(str, e.path)), e.message)]
    except SchemaNotFoundError as e:
        return [Problem(name, "", f"no schema: {e.message}")]
    return []


def validate(manifests: list[Manifest], kubernetes_version: str) -> list[Problem]:
    """Every problem in every manifest (empty: all valid)."""
    version = schema_version(kubernetes_version)
    crds = _crd_schemas(manifests)
    problems: list[Problem] = []
    for m in manifests:
        name = label(m)
        key = (m["apiVersion"], m["kind"])
        if key not in crds:
            problems += _builtin(m, version, name)
            continue
        validator = jsonschema.Draft7Validator(_closed(crds[key]))
        for e in sorted(validator.iter_errors(m), key=lambda e: list(map(str, e.path))):
            problems.append(Problem(name, ".".join(map(str, e.path)), e.message))
        templates = EMBEDDED_POD_TEMPLATES.get(f"{_group(m['apiVersion'])}/{m['kind']}")
        for path, template in templates(m) if templates else ():
            pod_template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": m["metadata"]["name"]},
                "template": template,
            }
            problems += [
                Problem(p.object, path + p.path.removeprefix("template"), p.message)
                for p in _builtin(pod_template, version, name)
            ]
    return problems


@dataclass(frozen=True)
class ManifestReport:
    out_dir: Path
    written: int
    schema_version: str
    kubernetes_version: str
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        head = (
            f"wrote {self.written} Kubernetes manifests to {self.out_dir}; validated against the Kubernetes "
            f"{self.schema_version} schemas (cluster {self.kubernetes_version}, strict) and CRD schemas: "
            f"{len(self.problems)} problem(s)"
        )
        return [head, *(f"  invalid manifest: {p}" for p in self.problems)]


def export(resources: Iterable[Any], out_dir: Path, kubernetes_version: str) -> ManifestReport:
    """`supernode preview --manifests DIR`: write every object and validate it."""
    manifests = from_resources(resources)
    try:
        paths = write(manifests, out_dir)
    except OSError as e:
        raise BadInput(f"--manifests {out_dir}: cannot write manifests there ({e.strerror or e})") from None
    return ManifestReport(
        out_dir,
        len(paths),
        schema_version(kubernetes_version),
        kubernetes_version,
        validate(manifests, kubernetes_version),
    )
