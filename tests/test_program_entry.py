"""The Pulumi program lives in the package (components/program.py, so the wheel ships it); the root
__main__.py the Pulumi CLI runs only imports it (issue 19, item 4)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from supernode.core.config import load_stack
from supernode.tools.preview import PROGRAM, run_program

ROOT = Path(__file__).resolve().parents[1]


def test_root_main_only_imports_the_program():
    body = [n for n in ast.parse((ROOT / "__main__.py").read_text()).body if not isinstance(n, ast.Expr)]
    assert len(body) == 1 and isinstance(body[0], ast.Import) and body[0].names[0].name == "components.program"
    assert PROGRAM == ROOT / "components" / "program.py"  # preview runs the packaged program


@pytest.mark.slow  # two previews under the mock engine
def test_the_cli_entry_point_deploys_what_preview_shows(monkeypatch):
    cfg = load_stack("dev", ROOT)
    monkeypatch.delitem(sys.modules, "components.program", raising=False)  # the shim's import runs it
    via_shim = run_program("dev", cfg, program=ROOT / "__main__.py")
    sys.modules.pop("components.program", None)
    direct = run_program("dev", cfg)
    assert len(via_shim.resources) > 100
    assert [r.urn for r in via_shim.resources] == [r.urn for r in direct.resources]
    assert via_shim.outputs == direct.outputs
