"""Readers for the files a user hands the CLI (stack files, policy configs, recorded resources): each
is bounded before it is parsed, so a hostile or mistaken input costs a clear error, not unbounded
memory or time.

- a regular file only (a FIFO would block for ever, a directory or device is a mistake), at most
  `limit` bytes, UTF-8;
- YAML: no aliases (an alias bomb expands a few hundred bytes into gigabytes; no stack needs one),
  no duplicate keys (the last would silently win: a repeated `supernode:model:` replaced the whole
  section), nesting at most MAX_DEPTH;
- JSON: no duplicate keys, no NaN/Infinity, no lone surrogates, nesting at most MAX_DEPTH;
- integers within 64 bits in both (a 400-digit integer is a typo, and big enough ones make
  arithmetic on them run for ever).

Every refusal is an InputError whose message names the file and what is wrong with it.
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from typing import Any

import yaml

MAX_DEPTH = 64
MAX_INT = 2**63 - 1
MIB = 1 << 20
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class InputError(ValueError):
    """An input file that is refused before or while it is parsed; the message names the file."""


def read_bounded(path: Path, limit: int, where: str) -> str:
    """The file's text, if it is a regular file of at most `limit` bytes of UTF-8."""
    try:
        st = Path(path).stat()
    except FileNotFoundError:
        raise InputError(f"{where}: file not found") from None
    except OSError as e:
        raise InputError(f"{where}: cannot be read ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{where}: is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{where}: is not a regular file (a pipe or device would be read without end)")
    if st.st_size > limit:
        raise InputError(f"{where}: {st.st_size:,} bytes, over the {limit:,}-byte limit for this file")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise InputError(f"{where}: cannot be read ({e.strerror or e})") from None
    if len(data) > limit:  # it grew since the stat
        raise InputError(f"{where}: over the {limit:,}-byte limit for this file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text (byte {e.start}: {data[e.start : e.start + 1]!r})") from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without aliases or duplicate keys, with bounded nesting and integers."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, "aliases (*name) are not accepted: write the value out", event.start_mark
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.constructor.ConstructorError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"duplicate key {key!r} (first at line {first.start_mark.line + 1}): the last would silently win",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        value = super().construct_yaml_int(node)
        if abs(value) > MAX_INT:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer {str(value)[:24]}... is beyond 64 bits", node.start_mark
            )
        return value


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:map", _StrictLoader.construct_yaml_map)


def load_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InputError(f"{where}: not valid YAML{at}: {problem}") from None
    except RecursionError:
        raise InputError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InputError(f"duplicate key {key!r}: the last would silently win")
        out[key] = value
    return out


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 19 or abs(int(text)) > MAX_INT:
        raise InputError(f"integer {text[:24]}{'...' if len(text) > 24 else ''} is beyond 64 bits")
    return int(text)


def _no_constant(name: str) -> Any:
    raise InputError(f"{name} is not a JSON number")


def _depth(value: Any) -> int:
    """Nesting depth, iteratively (a recursive walk is what deep input is built to break)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def load_json(text: str, where: str) -> Any:
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_bounded_int, parse_constant=_no_constant)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    except RecursionError:
        raise InputError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise InputError(f"{where}: not valid JSON ({str(e)[:200]})") from None
    if _depth(value) > MAX_DEPTH:
        raise InputError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    # A lone "\ud800" escape decodes to a string no file or terminal can hold. The text is UTF-8, so a
    # surrogate can only come from such an escape: re-encode the value only when the text has one.
    if SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"{where}: holds a lone surrogate ({e.object[e.start : e.end]!a}), not text") from None
    return value
