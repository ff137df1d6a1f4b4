"""Shared helpers: the real program (components/program.py) under the mock engine, for the stack files and variants.

Runs are cached per session (each is ~0.5 s once warm); a variant is the stack file's mapping
with changes applied and validated again, so it is a config a user could write.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supernode.core import resource_types as T
from supernode.core.config import StackConfig, from_mapping, load_stack
from supernode.tools.preview import PreviewResult, Resource, run_program

ROOT = Path(__file__).resolve().parents[2]

LT = T.LAUNCH_TEMPLATE
NODE_GROUP = T.NODE_GROUP
GPU_GROUP = "supernode:accelerators:GpuNodeGroup"


class Stack:
    """A preview with lookups by type, name and id."""

    def __init__(self, cfg: StackConfig, result: PreviewResult):
        self.cfg, self.result, self.outputs = cfg, result, result.outputs
        self.by_urn = {r.urn: r for r in result.resources}
        self.by_id = {r.id: r for r in result.resources if r.id}

    def all(self, typ: str) -> list[Resource]:
        return self.result.by_type(typ)

    def one(self, typ: str, name: str | None = None) -> Resource:
        found = [r for r in self.all(typ) if name is None or r.name == name]
        assert len(found) == 1, f"expected one {typ} {name or ''}, found {[r.name for r in found]}"
        return found[0]

    def children(self, parent: Resource, typ: str) -> list[Resource]:
        return [r for r in self.all(typ) if r.parent == parent.urn]

    def gpu_launch_templates(self) -> dict[str, Resource]:
        """Group name -> its launch template."""
        return {g.name: self.children(g, LT)[0] for g in self.all(GPU_GROUP)}


def policy(r: Resource, key: str = "policy") -> dict[str, Any]:
    return json.loads(r.inputs[key])


def statements(doc: dict[str, Any]) -> list[dict[str, Any]]:
    s = doc["Statement"]
    return s if isinstance(s, list) else [s]


def as_list(v: Any) -> list:
    return v if isinstance(v, list) else [v]


_cache: dict[tuple, Stack] = {}


def preview(stack: str, name: str = "", change: Callable[[dict], None] | None = None) -> Stack:
    """The stack (or a named variant of it) previewed once per session."""
    key = (stack, name)
    if key not in _cache:
        cfg = load_stack(stack, ROOT)
        if change is not None:
            data = copy.deepcopy(cfg.to_mapping())
            change(data)
            cfg = from_mapping(data, f"{stack} variant {name}")
        _cache[key] = Stack(cfg, run_program(stack, cfg))
    return _cache[key]


_INSIGHTS = re.compile(
    r'SELECT (?P<stat>\w+)\((?P<metric>\w+)\) FROM SCHEMA\("(?P<namespace>[^"]+)", (?P<keys>[\w, ]+)\)'
    r"(?: WHERE (?P<where>.*?))?(?: GROUP BY (?P<group>[\w, ]+))?(?: ORDER BY .*)?"
)


def insights_query(expression: str) -> dict[str, Any] | None:
    """A Metrics Insights query's parts (None for another expression): the namespace, the metric, the
    SCHEMA's dimension names, the WHERE clause's dimension values and the GROUP BY dimensions."""
    m = _INSIGHTS.fullmatch(expression or "")
    if not m:
        return None
    return {
        "stat": m["stat"],
        "namespace": m["namespace"],
        "metric": m["metric"],
        "schema": frozenset(k.strip() for k in m["keys"].split(",")),
        "where": dict(re.findall(r"(\w+) = '([^']*)'", m["where"] or "")),
        "group_by": [k.strip() for k in (m["group"] or "").split(",") if k.strip()],
    }


def insights_queries(alarm: dict[str, Any]) -> list[dict[str, Any]]:
    """The Metrics Insights queries of an alarm's metric queries."""
    return [q for q in (insights_query(x.get("expression")) for x in alarm.get("metricQueries") or []) if q]
