"""A pattern anchored `^...$` and applied with `re.match` accepts a trailing newline (`$` matches
before one): an image pinned `...@sha256:<64 hex>\n` passed the digest rule, and `--run 'base\n'`
named a directory no other command could find. Every such pattern is applied whole (`fullmatch`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pydantic
import pytest
from source_tree import source_files

from supernode.core.config import Images
from supernode.core.errors import BadInput
from supernode.core.runs import check_run_id

ROOT = Path(__file__).resolve().parents[1]
TRAINER = "123456789012.dkr.ecr.us-east-1.amazonaws.com/supernode-dev-trainer@sha256:" + "a" * 64


def _anchored_patterns(tree: ast.Module) -> set[str]:
    """Names bound at module level to `re.compile("^...$")`."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            is_compile = isinstance(call.func, ast.Attribute) and call.func.attr == "compile"
            if is_compile and call.args and isinstance(call.args[0], ast.Constant | ast.JoinedStr):
                text = ast.unparse(call.args[0])
                if text.strip("rf'\"").startswith("^") and text.strip("rf'\"").endswith("$"):
                    names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_every_anchored_pattern_is_applied_to_the_whole_string():
    files = source_files()
    sources = {f: ast.parse(f.read_text(encoding="utf-8")) for f in files}
    anchored = set().union(*(_anchored_patterns(t) for t in sources.values()))
    assert {"RUN_ID", "DIGEST_RE", "IMAGE_RE"} <= anchored  # the scan sees them
    partial = [
        f"{f.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}"
        for f, tree in sources.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("match", "search")
        and isinstance(node.value, ast.Name)
        and node.value.id in anchored
    ]
    assert not partial, "use fullmatch (match accepts a trailing newline):\n" + "\n".join(partial)


def test_a_trailing_newline_is_not_a_run_name_or_a_pinned_image():
    with pytest.raises(BadInput, match=r"--run 'base\\n': not a run name"):
        check_run_id("--run", "base\n")
    assert Images(trainer=TRAINER).trainer == TRAINER
    with pytest.raises(pydantic.ValidationError):
        Images(trainer=TRAINER + "\n")
