"""A read-only view of the stack for the policies: safe property access, links, the Plan.

Properties arrive as pulumi-policy's unknown-checking proxies (Mapping / Sequence). `get` walks them
lazily, so a value that is unknown during a real `pulumi preview` raises `UnknownValueError` only
when a policy actually needs it (the SDK then reports "can't run during preview" as advisory).
Links between resources (node group -> launch template, bucket -> its configuration resources) use
the engine's dependency lists, which the offline runner and the real CLI both supply.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from supernode.core.catalog import CATALOG, InstanceType
from supernode.core.plan import PLAN_CONFIGMAP_KEY, Plan
from supernode.core.resource_types import (
    CONFIG_MAP,
    CRON_JOB,
    DAEMON_SET,
    K8S_JOB,
    LAUNCH_TEMPLATE,
    LEADER_WORKER_SET,
    NODE_GROUP,
    POD,
    PYTORCH_JOB,
)

EFA_RESOURCE = "vpc.amazonaws.com/efa"
OPEN_CIDRS = ("0.0.0.0/0", "::/0")


def get(obj: Any, *path: Any, default: Any = None) -> Any:
    """obj[p0][p1]... or `default` when a step is missing; unknown values still raise."""
    for key in path:
        if isinstance(obj, Mapping):
            if key not in obj:
                return default
            obj = obj[key]
        elif isinstance(obj, Sequence) and not isinstance(obj, str) and isinstance(key, int):
            if not -len(obj) <= key < len(obj):
                return default
            obj = obj[key]
        else:
            return default
        if obj is None:
            return default
    return obj


def items(obj: Any) -> list:
    """A list-valued property as a list (missing or null: empty)."""
    return list(obj) if isinstance(obj, Sequence) and not isinstance(obj, str) else []


def plain(obj: Any) -> Any:
    """Proxies to plain dicts and lists (for remediations and JSON)."""
    if isinstance(obj, Mapping):
        return {k: plain(obj[k]) for k in obj}
    if isinstance(obj, Sequence) and not isinstance(obj, str):
        return [plain(v) for v in obj]
    return obj


def is_true(value: Any) -> bool:
    """Booleans as the engine passes them (AWS also accepts "true" strings in some fields)."""
    return value is True or (isinstance(value, str) and value.lower() == "true")


def json_doc(value: Any) -> dict | None:
    """An IAM-style policy document given as a JSON string or an object; None when absent or invalid."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return plain(value) if isinstance(value, Mapping) else None


def statements(doc: dict | None) -> list[dict]:
    st = (doc or {}).get("Statement", [])
    return [s for s in (st if isinstance(st, list) else [st]) if isinstance(s, dict)]


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


@dataclass
class Res:
    """One resource as the policies see it, whichever way it reached them."""

    type: str
    name: str
    urn: str
    props: Mapping[str, Any]
    parent: str = ""
    deps: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """`LaunchTemplate 'gpu-p5'`: how messages name a resource."""
        return f"{self.type.rsplit(':', 1)[-1]} '{self.name}'"

    def get(self, *path: Any, default: Any = None) -> Any:
        return get(self.props, *path, default=default)


class PlanError(Exception):
    """The plan ConfigMap exists but does not hold a valid Plan."""


class Stack:
    """All resources of one stack, with the lookups the checklist needs."""

    def __init__(self, resources: Iterable[Res]):
        self.resources = list(resources)
        self.by_urn = {r.urn: r for r in self.resources}
        self._plan: tuple[Plan | None] | None = None  # plan() memo: (the Plan or None,) once parsed

    @classmethod
    def from_policy_resources(cls, resources: Iterable[Any]) -> Stack:
        """From `StackValidationArgs.resources` (pulumi_policy.PolicyResource)."""
        return cls(
            Res(
                type=r.resource_type,
                name=r.name,
                urn=r.urn,
                props=r.props,
                parent=r.parent.urn if r.parent is not None else (r.opts.parent or ""),
                deps=[d.urn for d in r.dependencies],
            )
            for r in resources
        )

    @classmethod
    def from_json(cls, resources: Iterable[dict[str, Any]]) -> Stack:
        """From recorded resources (`supernode preview --json`), e.g. to inspect what the policies see."""
        return cls(
            Res(
                type=r["type"],
                name=r["name"],
                urn=r["urn"],
                props=r.get("inputs") or {},
                parent=r.get("parent") or "",
                deps=list(r.get("dependencies") or []),
            )
            for r in resources
        )

    def of(self, *types: str) -> list[Res]:
        return [r for r in self.resources if r.type in types]

    def ancestors(self, res: Res) -> list[str]:
        out, urn = [], res.parent
        while urn and urn not in out:
            out.append(urn)
            urn = self.by_urn[urn].parent if urn in self.by_urn else ""
        return out

    def depends_on(self, res: Res, target: Res) -> bool:
        """`res` depends on `target` directly or on a component that contains it."""
        return target.urn in res.deps or any(a in res.deps for a in self.ancestors(target))

    def attached(self, res: Res, types: tuple[str, ...]) -> list[Res]:
        """Resources of `types` that depend on `res` (e.g. a bucket's configuration resources)."""
        return [r for r in self.of(*types) if self.depends_on(r, res)]

    # -- compute ---------------------------------------------------------------------------
    def launch_template_of(self, node_group: Res) -> Res | None:
        lt_name = node_group.get("launchTemplate", "name")
        for lt in self.of(LAUNCH_TEMPLATE):
            if lt.urn in node_group.deps or (lt_name and lt_name in (lt.get("name"), lt.name)):
                return lt
        return None

    def instance_type_of(self, node_group: Res) -> str | None:
        types = items(node_group.get("instanceTypes"))
        if types:
            return types[0]
        lt = self.launch_template_of(node_group)
        return lt.get("instanceType") if lt else None

    def is_gpu_node_group(self, ng: Res) -> bool:
        itype = self.instance_type_of(ng) or ""
        taints = " ".join(str(get(t, "key", default="")) for t in items(ng.get("taints")))
        return (
            "NVIDIA" in str(ng.get("amiType", default="")).upper()
            or itype in CATALOG
            or itype.split(".")[0][:1] in ("p", "g")
            or "nvidia.com/gpu" in taints
        )

    def gpu_node_groups(self) -> list[Res]:
        return [ng for ng in self.of(NODE_GROUP) if self.is_gpu_node_group(ng)]

    def gpu_launch_templates(self) -> list[Res]:
        """Launch templates of GPU node groups, and any launch template for a catalog instance type."""
        out = {lt.urn: lt for ng in self.gpu_node_groups() if (lt := self.launch_template_of(ng))}
        out.update({lt.urn: lt for lt in self.of(LAUNCH_TEMPLATE) if lt.get("instanceType") in CATALOG})
        return list(out.values())

    # -- the plan --------------------------------------------------------------------------
    def plan_config_map(self) -> Res | None:
        for cm in self.of(CONFIG_MAP):
            if cm.get("data", PLAN_CONFIGMAP_KEY) is not None:
                return cm
        return None

    def plan(self) -> Plan | None:
        """The Plan the job runs: parsed from the plan ConfigMap with the core's own deserialiser,
        once per Stack (an invalid plan raises PlanError on every call)."""
        if self._plan is None:
            cm = self.plan_config_map()
            self._plan = (None if cm is None else _parse_plan(cm),)
        return self._plan[0]

    # -- kubernetes workloads ---------------------------------------------------------------
    def trainer_jobs(self) -> list[Res]:
        """PyTorchJobs that run the trainer (the interconnect gate may be a PyTorchJob too)."""
        return [j for j in self.of(PYTORCH_JOB) if not is_gate(j)]

    def gates(self) -> list[Res]:
        return [r for r in self.of(K8S_JOB, PYTORCH_JOB) if is_gate(r)]


def _parse_plan(cm: Res) -> Plan:
    text = cm.get("data", PLAN_CONFIGMAP_KEY)
    try:
        if not isinstance(text, str):
            raise ValueError(f"expected a JSON string, got {type(text).__name__}")
        return _plan_from_json(text)
    except (ValidationError, ValueError) as e:
        raise PlanError(
            f"{cm.label} holds data['{PLAN_CONFIGMAP_KEY}'] that is not a valid supernode Plan "
            f"({str(e).splitlines()[0]}); generate it with supernode.core.plan.Plan.to_json()"
        ) from None


@functools.lru_cache(maxsize=4)
def _plan_from_json(text: str) -> Plan:
    # Keyed on the ConfigMap's text, so every policy of one analysis shares one parse even where each
    # gets its own Stack (pulumi-policy hands every stack policy freshly built resources). The Plan is
    # frozen, and equal text is an equal Plan, so sharing it across analyses is safe too.
    return Plan.from_json(text)


def pod_templates(res: Res) -> list[Any]:
    """Pod templates of a workload object: PyTorchJob replica specs, a CronJob's job template, a
    LeaderWorkerSet's leader and worker templates, or the template of Job/Deployment/..."""
    if res.type == PYTORCH_JOB:
        specs = res.get("spec", "pytorchReplicaSpecs", default={})
        found = [get(specs, role, "template") for role in specs]
    elif res.type == CRON_JOB:
        found = [res.get("spec", "jobTemplate", "spec", "template")]
    elif res.type == LEADER_WORKER_SET:
        lws = res.get("spec", "leaderWorkerTemplate", default={})
        found = [get(lws, role) for role in ("leaderTemplate", "workerTemplate")]
    else:
        found = [res.get("spec", "template")]
    return [t for t in found if t is not None]


def pod_specs(res: Res) -> list[Any]:
    """Pod specs of a workload object (a Pod's own, else its templates')."""
    if res.type == POD:
        return [s] if (s := res.get("spec")) is not None else []
    return [s for t in pod_templates(res) if (s := get(t, "spec")) is not None]


def containers(res: Res, init: bool = False) -> list[Any]:
    out = []
    for spec in pod_specs(res):
        out += items(get(spec, "containers"))
        if init:
            out += items(get(spec, "initContainers"))
    return out


def command_line(container: Any) -> str:
    return " ".join(str(x) for x in items(get(container, "command")) + items(get(container, "args")))


def is_fabric_check(container: Any) -> bool:
    return "supernode.trainer.node.fabric" in command_line(container)


def is_gate(res: Res) -> bool:
    """The interconnect gate runs the trainer image's fabric check."""
    return any(is_fabric_check(c) for c in containers(res))


def mounts_config_map(spec: Any, config_map: str) -> bool:
    """A pod spec mounts ConfigMap `config_map` in one of its containers (a configMap volume of it, mounted)."""
    volumes = {get(v, "name") for v in items(get(spec, "volumes")) if get(v, "configMap", "name") == config_map}
    return any(get(m, "name") in volumes for c in items(get(spec, "containers")) for m in items(get(c, "volumeMounts")))


def resource_quantity(container: Any, name: str) -> float | None:
    """A container's limit (or request) for an extended resource such as vpc.amazonaws.com/efa."""
    for kind in ("limits", "requests"):
        value = get(container, "resources", kind, name)
        if value is not None:
            try:
                return float(value)
            except (TypeError, ValueError):
                return None
    return None


def hardware(stack: Stack) -> InstanceType:
    """The plan's accelerator, or an NVIDIA GPU where no plan names one (the pack's original reading)."""
    plan = stack.plan()
    return CATALOG[plan.instance_type if plan is not None and plan.instance_type in CATALOG else "p5.48xlarge"]


def daemon_sets_running(stack: Stack, image: str) -> list[Res]:
    """The DaemonSets that run `image` (an add-on's, e.g. the vendor's device plugin or exporter)."""
    return [
        d
        for d in stack.of(DAEMON_SET)
        if image in d.name.lower() or any(image in str(get(c, "image")) for c in containers(d))
    ]


def plan_config_map_name(stack: Stack) -> str | None:
    """The name of the ConfigMap that holds the plan, if the stack has one."""
    cm = stack.plan_config_map()
    return (cm.get("metadata", "name") or cm.name) if cm else None
