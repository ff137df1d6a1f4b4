"""docs/configuration.md, generated from the schema and the rules' docstrings (never by hand):
`supernode config reference > docs/configuration.md`; a test fails when the file is stale."""

from __future__ import annotations

import inspect
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import AwareDatetime, BaseModel
from pydantic.fields import FieldInfo

from ..catalog import CATALOG, SYSTEM_INSTANCE_TYPES
from ..layout import layout_rules
from .rules import RULES
from .schema import CW_RETENTION_DAYS, DIGEST_RE, FSX_PER_UNIT_THROUGHPUT, NAMESPACE, StackConfig

# Allowed values that field validators enforce (the schema cannot show them by itself).
VALIDATED = {
    ("AcceleratorNodeGroup", "instance_type"): "one of " + ", ".join(CATALOG),
    ("SystemNodeGroup", "instance_type"): "one of " + ", ".join(SYSTEM_INSTANCE_TYPES),
    ("FsxConfig", "capacity_gib"): "1200 or a multiple of 2400",
    ("FsxConfig", "per_unit_throughput"): "one of " + ", ".join(map(str, FSX_PER_UNIT_THROUGHPUT)),
    ("MonitoringConfig", "log_retention_days"): "one of " + ", ".join(map(str, CW_RETENTION_DAYS)),
    ("Images", "trainer"): f"pinned by digest: `{DIGEST_RE.pattern}`",
    ("Images", "fabric_check"): f"pinned by digest: `{DIGEST_RE.pattern}`",
    ("Images", "addons"): "keys as listed; each value an image by tag (not `latest`) or digest",
}


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for arg in (annotation, *get_args(annotation), *(a for t in get_args(annotation) for a in get_args(t))):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _type(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "string"
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type(a) for a in inner) + (" (optional)" if len(inner) < len(args) else "")
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return f"mapping of {_type(args[0])} to {_type(args[1])}"
    if _model_of(annotation) is not None:
        return "mapping"
    if args and hasattr(annotation, "__metadata__"):  # Annotated[str, Field(...)]
        return _type(args[0])
    return {
        str: "string",
        int: "integer",
        float: "number",
        bool: "boolean",
        AwareDatetime: "ISO 8601 date-time with its offset",
    }.get(annotation, str(annotation))


def _allowed(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    parts = []
    literal = [a for a in (field.annotation, *get_args(field.annotation)) if get_origin(a) is Literal]
    if literal:
        parts.append(", ".join(f"`{v}`" for v in get_args(literal[0])))
    for m in field.metadata + [m for a in get_args(field.annotation) for m in getattr(a, "__metadata__", ())]:
        for attr, op in (
            ("ge", ">="),
            ("gt", ">"),
            ("le", "<="),
            ("lt", "<"),
            ("min_length", "at least"),
            ("pattern", "matches"),
        ):
            value = getattr(m, attr, None)
            if value is None and hasattr(m, "metadata"):
                value = next((getattr(x, attr) for x in m.metadata if getattr(x, attr, None) is not None), None)
            if value is not None:
                parts.append(
                    f"{op} `{value}`"
                    if attr == "pattern"
                    else f"{op} {value} {'character(s)' if _type(field.annotation).startswith('string') else 'item(s)'}"
                    if attr == "min_length"
                    else f"{op} {value}"
                )
    if (model.__name__, name) in VALIDATED:
        parts.append(VALIDATED[(model.__name__, name)])
    return "; ".join(dict.fromkeys(parts))


def unset_meaning(field: FieldInfo) -> str:
    """What the stack does when an optional key is left out (schema.when_unset), or ''."""
    extra = field.json_schema_extra
    return str(extra.get("unset", "")) if isinstance(extra, dict) else ""


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if value is None:  # the default depends on other keys: say what it is and when
        return f"unset: {unset_meaning(field)}" if unset_meaning(field) else ""
    if isinstance(value, BaseModel):
        return "(defaults below)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section(model: type[BaseModel], path: str, out: list[str]) -> None:
    if model.__name__.endswith("Override"):  # local.model / local.parallel / local.training
        base = path.rsplit(".", 1)[-1]
        out += [
            f"### `{NAMESPACE}:{path}`",
            "",
            f"Any key of `{NAMESPACE}:{base}`, with its type and allowed values, overriding it for the local CPU run.",
            "",
        ]
        return
    rows, nested = [], []
    for name, field in model.model_fields.items():
        key = field.alias or name
        sub = _model_of(field.annotation)
        rows.append(
            f"| `{key}` | {_type(field.annotation)} | {_cell(_default(field))} | "
            f"{_cell(_allowed(model, name, field))} | {_cell(field.description or '')} |"
        )
        if sub is not None:
            nested.append((sub, f"{path}.{key}" if path else key, get_origin(field.annotation) is list))
    title = f"`{NAMESPACE}:{path}`" if path else f"`{NAMESPACE}:*` (top level)"
    doc = inspect.getdoc(model) if model.__doc__ and model.__module__.endswith("schema") else ""
    out += [f"### {title}", ""] + ([doc.replace("\n", " "), ""] if doc else [])
    out += ["| key | type | default | allowed | description |", "|---|---|---|---|---|", *rows, ""]
    for sub, sub_path, is_list in nested:
        _section(sub, sub_path + ("[]" if is_list else ""), out)


def reference() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from the schema (`supernode/core/config/schema.py`) and the rules' docstrings "
        "by `supernode config reference`; do not edit by hand (a test fails when this file is stale).",
        "",
        f"Every key lives in the `{NAMESPACE}:` namespace of `Pulumi.<stack>.yaml` (what `pulumi config set --path` "
        "writes). Unknown keys are errors (with a did-you-mean suggestion), and every problem is reported at "
        "once with its path and value, exit 2.",
        "",
        "## Keys",
        "",
    ]
    _section(StackConfig, "", out)
    out += [
        "## Rules across keys",
        "",
        "Checked after the schema; when some sections fail the schema, the rules over the valid sections "
        "still run, so one run reports every problem.",
        "",
    ]
    for sections, rule in RULES:
        keys = [StackConfig.model_fields[n].alias or n for n in sections]
        out.append(
            f"- **{', '.join(keys) if len(keys) < 6 else 'the whole stack'}**: "
            f"{inspect.getdoc(rule).replace(chr(10), ' ')}"
        )
    out += [
        "",
        "### The layout validator",
        "",
        "One validator (`supernode/core/layout.py`) for the stack, its `local` section, the planner's "
        "suggestions and the trainer's start-up check:",
        "",
        inspect.getdoc(layout_rules).replace("\n", " "),
        "",
    ]
    return "\n".join(out)
