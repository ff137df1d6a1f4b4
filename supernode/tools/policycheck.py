"""Run the CrossGuard pack offline, in-process, through pulumi-policy's own analyzer.

`pulumi_policy.policy._PolicyAnalyzerServicer` is what `pulumi preview --policy-pack` talks to over
gRPC; here we call it directly with the same protobuf requests (private API: pulumi-policy is
pinned exactly in requirements.txt). Like the engine, per resource we run Remediate first and
analyze the remediated properties, then one AnalyzeStack over every resource. Input is the
recorded `resources` list of `supernode preview --json` (docs/architecture.md §7), so a PR check needs
neither the Pulumi CLI nor cloud credentials.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import json_format, struct_pb2
from pulumi.runtime.proto import analyzer_pb2
from pulumi_policy import EnforcementLevel
from pulumi_policy.policy import _PolicyAnalyzerServicer

from supernode.policies.base import MalformedInput, one_analysis
from supernode.policies.pack import BY_NAME, CHECKLIST_ITEMS, PACK_NAME, POLICIES, item_of
from supernode.policies.security import IMAGE_POLICIES, REMEDIATING_POLICIES
from supernode.policies.settings import PolicyConfigError

from ..core.config import StackConfig
from ..core.inputs import MIB, InputError, load_json, load_yaml, read_bounded

PACK_VERSION = "0.1.0"
LEVELS = {level.value: level for level in EnforcementLevel}
_PROTO_LEVEL = {
    EnforcementLevel.ADVISORY: analyzer_pb2.ADVISORY,
    EnforcementLevel.MANDATORY: analyzer_pb2.MANDATORY,
    EnforcementLevel.REMEDIATE: analyzer_pb2.REMEDIATE,
    EnforcementLevel.DISABLED: analyzer_pb2.DISABLED,
}


class PolicyInputError(ValueError):
    """A resources file or policy config the runner cannot use (the CLI exits 2)."""


@dataclass
class Violation:
    policy: str
    enforcement: str
    urn: str
    message: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class Remediation:
    policy: str
    urn: str
    properties: dict[str, Any]


@dataclass
class PolicyReport:
    policies: dict[str, str]  # name -> effective enforcement level
    violations: list[Violation] = field(default_factory=list)
    remediations: list[Remediation] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # urn -> resource name, for display

    @property
    def mandatory(self) -> list[Violation]:
        return [v for v in self.violations if v.enforcement == "mandatory"]

    @property
    def passed(self) -> bool:
        return not self.mandatory

    def rows(self) -> list[dict[str, Any]]:
        """One row per finding, and one `pass` row per policy without findings: the compliance table."""
        out = []
        for name, level in self.policies.items():
            found = [
                {
                    "result": "fail" if v.enforcement == "mandatory" else "warn",
                    "enforcement": v.enforcement,
                    "urn": v.urn,
                    "message": v.message,
                }
                for v in self.violations
                if v.policy == name
            ] + [
                {
                    "result": "remediated",
                    "enforcement": "remediate",
                    "urn": r.urn,
                    "message": "properties fixed by the policy's remediation",
                }
                for r in self.remediations
                if r.policy == name
            ]
            if level == "disabled":
                found = [{"result": "disabled", "enforcement": level, "urn": "", "message": ""}]
            for row in found or [{"result": "pass", "enforcement": level, "urn": "", "message": ""}]:
                out.append(
                    {
                        "item": item_of(name),
                        "policy": name,
                        **row,
                        "resource": self.names.get(row["urn"], row["urn"].rsplit("::", 1)[-1] if row["urn"] else ""),
                    }
                )
        return sorted(out, key=lambda r: (r["item"], r["policy"]))

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "violations": [v.to_json() for v in self.violations],
            "remediations": [asdict(r) for r in self.remediations],
            "policies": [{"policy": n, "item": item_of(n), "enforcement": lvl} for n, lvl in self.policies.items()],
        }


# -- inputs ---------------------------------------------------------------------------------------

# A prod preview is about 1 MB of JSON; anything near this is not a preview (and reading it whole would hurt).
MAX_RESOURCES_BYTES = 64 * MIB
MAX_POLICY_CONFIG_BYTES = MIB
MAX_PROBLEMS = 20  # listed in one error; the rest are counted


def _quote(value: Any, limit: int = 80) -> str:
    """A value as an error message quotes it: never more than `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def load_resources(path: Path) -> list[dict[str, Any]]:
    """A `supernode preview --json` document or a bare resources list, checked entry by entry."""
    where = f"--resources {path}"
    try:  # a prod preview is about 0.5 MB
        data = load_json(read_bounded(path, MAX_RESOURCES_BYTES, where), where)
    except InputError as e:
        raise PolicyInputError(str(e)) from None
    resources = data.get("resources") if isinstance(data, dict) else data
    if not isinstance(resources, list):
        raise PolicyInputError(
            f"{where}: expected a list of resources or an object with a 'resources' "
            f"list (the output of `supernode preview --json`), got {type(data).__name__}"
        )
    if not resources:
        raise PolicyInputError(
            f"{where}: holds no resources, so there is nothing to check (a passing check "
            f"of nothing would be vacuous); give the output of `supernode preview --json`"
        )
    problems = []
    for i, r in enumerate(resources):
        if not isinstance(r, dict):
            problems.append(f"resources[{i}]: expected an object, got {_quote(r)}")
            continue
        for key in ("urn", "type", "name"):
            if not isinstance(r.get(key), str) or not r.get(key):
                problems.append(f"resources[{i}].{key}: required non-empty string (got {_quote(r.get(key))})")
        for key, kind in (("inputs", dict), ("dependencies", list), ("parent", str)):
            if r.get(key) is not None and not isinstance(r[key], kind):
                problems.append(
                    f"resources[{i}].{key}: expected {'an object' if kind is dict else 'a list' if kind is list else 'a string'} "  # noqa: E501
                    f"(got {_quote(r[key])})"
                )
        deps = r.get("dependencies")
        if isinstance(deps, list) and not all(isinstance(d, str) for d in deps):
            problems.append(f"resources[{i}].dependencies: expected a list of URNs (got {_quote(deps)})")
    if problems:
        more = f"; and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
        raise PolicyInputError(f"{where}: " + "; ".join(problems[:MAX_PROBLEMS]) + more)
    return resources


def load_policy_config(path: Path) -> dict[str, Any]:
    """A policy config file in the Pulumi CLI's `--policy-pack-config` format (JSON, or YAML)."""
    where = f"--policy-config {path}"
    try:
        data = load_yaml(read_bounded(path, MAX_POLICY_CONFIG_BYTES, where), where)  # JSON is YAML
    except InputError as e:
        raise PolicyInputError(str(e)) from None
    if not isinstance(data, dict):
        raise PolicyInputError(
            f"--policy-config {path}: expected an object of policy name -> level or settings, got {data!r}"
        )
    return data


def config_from_stack(cfg: StackConfig) -> dict[str, Any]:
    """What `supernode preview` tells the pack about the stack (a real CLI run passes the same file).
    The image policies are mandatory in the pack; a stack with images.requireDigests false (dev) lowers
    them to advisory, so its add-on tags and placeholder trainer digest warn instead of failing. The
    remediating policies are mandatory here: a check fails what only an update with the pack would fix."""
    images = "mandatory" if cfg.images.require_digests else "advisory"
    return {
        "data-ready": {"datasetPrefix": cfg.storage.dataset_prefix},
        "checkpoint-lifecycle": {"checkpointPrefix": cfg.storage.checkpoint_prefix},
        "lb-ingress-allowed-cidrs": {"allowedCidrs": list(cfg.management.allowed_cidrs)},
        **{name: {"enforcementLevel": images} for name in IMAGE_POLICIES},
        **{name: {"enforcementLevel": "mandatory"} for name in REMEDIATING_POLICIES},
    }


def _configure_request(config: dict[str, Any]) -> tuple[analyzer_pb2.ConfigureAnalyzerRequest, dict[str, str]]:
    """Every policy gets its level explicitly: the servicer treats a configured policy without one as advisory."""
    unknown = sorted(set(config) - set(BY_NAME) - {"all"})
    if unknown:
        raise PolicyInputError(f"policy config names unknown policies {unknown}; valid: all, {', '.join(BY_NAME)}")
    default_all = config.get("all")
    request, levels, problems = analyzer_pb2.ConfigureAnalyzerRequest(), {}, []
    for name, policy in BY_NAME.items():
        value = config.get(name, {})
        level_name = (value.get("enforcementLevel") if isinstance(value, dict) else value) or default_all
        props = {k: v for k, v in value.items() if k != "enforcementLevel"} if isinstance(value, dict) else {}
        if level_name is not None and level_name not in LEVELS:
            problems.append(f"{name}.enforcementLevel: must be one of {', '.join(LEVELS)} (got {level_name!r})")
            continue
        level = LEVELS[level_name] if level_name else (policy.enforcement_level or EnforcementLevel.MANDATORY)
        if props and policy.settings is None:
            problems.append(f"{name}: takes no settings (got {sorted(props)})")
            continue
        try:
            policy.settings_from(props)  # validated here, so a bad value is input error (exit 2), not a crash mid-run
        except PolicyConfigError as e:
            problems.append(str(e))
            continue
        entry = request.policyConfig[name]
        entry.enforcementLevel = _PROTO_LEVEL[level]
        entry.properties.update(props)
        levels[name] = level.value
    if problems:
        raise PolicyInputError("invalid policy config: " + "; ".join(problems))
    return request, levels


# -- the run --------------------------------------------------------------------------------------


def _struct(props: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(props)
    return s


def check(resources: list[dict[str, Any]], config: dict[str, Any] | None = None) -> PolicyReport:
    servicer = _PolicyAnalyzerServicer(PACK_NAME, PACK_VERSION, POLICIES, EnforcementLevel.MANDATORY)
    request, levels = _configure_request(config or {})
    servicer.Configure(request, None)
    report = PolicyReport(policies=levels, names={r["urn"]: r["name"] for r in resources})
    level_name = {v: k.value for k, v in _PROTO_LEVEL.items()}

    def collect(diagnostics: Any, urn: str = "") -> None:
        for d in diagnostics:
            report.violations.append(
                Violation(
                    policy=d.policyName, enforcement=level_name[d.enforcementLevel], urn=d.urn or urn, message=d.message
                )
            )

    try:
        return _analyze(servicer, resources, report, collect)
    except MalformedInput as e:
        raise PolicyInputError(
            f"{e}; the resources must be recorded by `supernode preview --json` (or have the same shape)"
        ) from None


def _analyze(servicer: Any, resources: list[dict[str, Any]], report: PolicyReport, collect: Any) -> PolicyReport:
    analyzed = []
    for r in resources:
        props = r.get("inputs") or {}
        options = analyzer_pb2.AnalyzerResourceOptions(parent=r.get("parent") or "")
        if r.get("custom", True):
            req = analyzer_pb2.AnalyzeRequest(
                type=r["type"], properties=_struct(props), urn=r["urn"], name=r["name"], options=options
            )
            for rem in servicer.Remediate(req, None).remediations:
                if rem.diagnostic:
                    report.violations.append(Violation(rem.policyName, "advisory", r["urn"], rem.diagnostic))
                elif rem.HasField("properties"):
                    props = json_format.MessageToDict(rem.properties)
                    report.remediations.append(Remediation(rem.policyName, r["urn"], props))
            req.properties.Clear()
            req.properties.update(props)
            collect(servicer.Analyze(req, None).diagnostics, r["urn"])
        analyzed.append(
            analyzer_pb2.AnalyzerResource(
                type=r["type"],
                properties=_struct(props),
                urn=r["urn"],
                name=r["name"],
                options=options,
                parent=r.get("parent") or "",
                dependencies=r.get("dependencies") or [],
            )
        )
    with one_analysis():  # the stack policies of this one AnalyzeStack share one parsed Stack
        collect(servicer.AnalyzeStack(analyzer_pb2.AnalyzeStackRequest(resources=analyzed), None).diagnostics)
    return report


# -- reports --------------------------------------------------------------------------------------


def junit_xml(report: PolicyReport) -> str:
    """One testcase per policy (classname = checklist item); mandatory violations are failures."""
    suite = ET.Element(
        "testsuite",
        name=PACK_NAME,
        tests=str(len(report.policies)),
        failures=str(len({v.policy for v in report.mandatory})),
        errors="0",
        skipped="0",
    )
    for name in report.policies:
        item = item_of(name)
        case = ET.SubElement(
            suite, "testcase", name=name, classname=f"checklist.{item:02d}.{CHECKLIST_ITEMS[item].replace(' ', '_')}"
        )
        mandatory = [v for v in report.mandatory if v.policy == name]
        if mandatory:
            failure = ET.SubElement(
                case, "failure", message=f"{len(mandatory)} mandatory violation(s)", type="mandatory"
            )
            failure.text = "\n\n".join(f"{v.urn}\n{v.message}" for v in mandatory)
        notes = [
            f"advisory: {v.urn}\n{v.message}"
            for v in report.violations
            if v.policy == name and v.enforcement != "mandatory"
        ]
        notes += [f"remediated: {r.urn}" for r in report.remediations if r.policy == name]
        if notes:
            ET.SubElement(case, "system-out").text = "\n\n".join(notes)
    ET.indent(suite)
    return ET.tostring(ET.ElementTree(suite).getroot(), encoding="unicode", xml_declaration=True)
