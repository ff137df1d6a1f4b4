"""Reading a stack: `Pulumi.<stack>.yaml` (or Pulumi's runtime config) -> a validated StackConfig.

`from_mapping` is the one entry point: the schema first, then the cross-field rules, every problem
reported at once as a ConfigError (exit 2).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ..errors import ConfigError, Issue
from ..inputs import MIB, InputError, load_yaml, read_bounded
from ..layout import P
from .rules import rules
from .schema import NAMESPACE, StackConfig, did_you_mean, issues_from_validation

MAX_STACK_FILE_BYTES = MIB


def from_mapping(data: Any, source: str = "") -> StackConfig:
    """Validate the `supernode:` keys (without the namespace) and the cross-field rules."""
    if not isinstance(data, dict):
        raise ConfigError(
            [Issue(path=P.rstrip(":"), value=data, message="expected a mapping of supernode:* keys")], source
        )
    try:
        cfg = StackConfig.model_validate(data)
    except ValidationError as e:
        schema_issues = issues_from_validation(e, P, data)
        partial, valid = _valid_sections(data, e)
        raise ConfigError(schema_issues + rules(partial, valid), source) from None
    problems = rules(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _valid_sections(data: dict, err: ValidationError) -> tuple[StackConfig, set[str]]:
    """The top-level sections that passed the schema, validated one by one, in a StackConfig built
    without validation (the failed sections are absent: only rules that skip them may read it)."""
    failed = {e["loc"][0] for e in err.errors() if e["loc"]}
    values: dict[str, Any] = {}
    for name, field in StackConfig.model_fields.items():
        key = field.alias or name
        if key in failed or name in failed:
            continue
        if key in data:
            values[name] = TypeAdapter(field.annotation).validate_python(data[key])
        elif not field.is_required():
            values[name] = field.get_default(call_default_factory=True)
    return StackConfig.model_construct(**values), set(values)


def read_stack_file(path: Path, by_name: bool = False) -> dict[str, Any]:
    """The `supernode:` keys of a Pulumi.<stack>.yaml, namespace stripped; other namespaces checked lightly.
    `by_name`: the path was made from a stack name and a project directory (`--stack`, `--root`)."""
    src = str(path)
    if not path.exists():
        where = path.parent.resolve()
        stacks = sorted(f.name for f in path.parent.glob("Pulumi.*.yaml")) if path.parent.is_dir() else []
        found = f"it holds {', '.join(stacks)}" if stacks else "it holds no Pulumi.*.yaml"
        fix = (
            "; pass --root DIR, the directory that holds the stack files (default: the current directory), "
            "or --config FILE"
            if by_name
            else ""
        )
        message = f"stack file not found in {where} ({found}){fix}"
        raise ConfigError([Issue(path=src, message=message, missing=True)], src)
    try:  # a stack file is a few KB; bounded, without aliases or duplicate keys (supernode.core.inputs)
        doc = load_yaml(read_bounded(path, MAX_STACK_FILE_BYTES, src), src)
    except InputError as e:
        raise ConfigError([Issue(path=src, message=str(e).removeprefix(f"{src}: "), missing=True)], src) from None
    if doc is None:
        raise ConfigError(
            [Issue(path=src, message="file is empty; expected a top-level 'config:' mapping", missing=True)], src
        )
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        raise ConfigError(
            [
                Issue(
                    path="config",
                    value=doc if not isinstance(doc, dict) else doc.get("config"),
                    message="expected a top-level 'config:' mapping of namespace:key entries",
                )
            ],
            src,
        )
    issues, data = [], {}
    for key, value in doc["config"].items():
        if not isinstance(key, str) or ":" not in key:
            issues.append(
                Issue(path=f"config.{key}", value=value, message="config keys are namespace:key, e.g. supernode:region")
            )
            continue
        ns, name = key.split(":", 1)
        if ns == NAMESPACE:
            data[name] = value
        elif did_you_mean(ns, [NAMESPACE]):  # `supernod:monitoring` would otherwise be ignored silently
            issues.append(
                Issue(
                    path=f"config.{key}",
                    value=value,
                    message=f"unknown namespace {ns!r}; did you mean {NAMESPACE!r} ({NAMESPACE}:{name})?",
                )
            )
    region = doc["config"].get("aws:region")
    if region is not None and data.get("region") not in (None, region):
        issues.append(
            Issue(path="aws:region", value=region, message=f"must equal supernode:region ({data.get('region')})")
        )
    try:
        cfg_issues: list[Issue] = []
        from_mapping(data, src)
    except ConfigError as e:
        cfg_issues = e.issues
    if issues or cfg_issues:
        raise ConfigError(issues + cfg_issues, src)
    return data


def load_stack(stack: str, root: Path = Path(".")) -> StackConfig:
    path = Path(root) / f"Pulumi.{stack}.yaml"
    return from_mapping(read_stack_file(path, by_name=True), str(path))


def load_file(path: Path) -> StackConfig:
    return from_mapping(read_stack_file(Path(path)), str(path))


def with_local_nproc(cfg: StackConfig, nproc: int) -> StackConfig:
    """The stack with `local.nproc = nproc` and the local dpShard scaled to it (the other local
    degrees kept), validated like a stack file: the one place a CPU run's layout is re-sized."""
    if nproc == cfg.local.nproc:
        return cfg
    p = cfg.local_config().parallel
    kept = p.factors(without="dp_shard")
    fixed = math.prod(kept.values())
    if nproc < 1 or nproc % fixed:
        raise ConfigError(
            [
                Issue(
                    path="--nproc",
                    value=nproc,
                    message=f"must be a positive multiple of the local "
                    f"{'*'.join(kept)} ({'*'.join(map(str, kept.values()))} = {fixed})",
                )
            ],
            "--nproc",
        )
    data = cfg.to_mapping()
    data["local"]["nproc"], data["local"]["parallel"]["dpShard"] = nproc, p.rescaled(nproc).dp_shard
    return from_mapping(data, f"--nproc {nproc}")
