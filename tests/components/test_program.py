"""The Pulumi program is a function in the package (components/program.py, so the wheel ships it): the
root __main__.py the Pulumi CLI runs only calls its `main()`, the preview calls `program`, and
importing the module declares nothing (issue 19, item 4; issue 25, item 4)."""

from __future__ import annotations

import ast
import importlib
import runpy
from pathlib import Path

import pytest

import supernode.components.program
from supernode.core.config import load_stack
from supernode.tools.preview import run_program

ROOT = Path(__file__).resolve().parents[2]


def test_root_main_only_calls_the_programs_main():
    imported, called = ast.parse((ROOT / "__main__.py").read_text()).body[-2:]
    assert ast.unparse(imported) == "from supernode.components.program import main"
    assert ast.unparse(called) == "main()"


def test_importing_the_program_declares_nothing():
    """Under the engine, with the stack's config set: the import alone registers no resource, no output."""
    result = run_program("dev", load_stack("dev", ROOT), lambda *_: importlib.reload(supernode.components.program))
    assert result.resources == [] and result.outputs == {}


@pytest.mark.slow  # two previews under the mock engine
def test_the_cli_entry_point_deploys_what_preview_shows():
    cfg = load_stack("dev", ROOT)
    via_cli = run_program("dev", cfg, lambda *_: runpy.run_path(str(ROOT / "__main__.py"), run_name="__main__"))
    direct = run_program("dev", cfg)
    assert len(via_cli.resources) > 100
    assert [r.to_json() for r in via_cli.resources] == [r.to_json() for r in direct.resources]
    assert via_cli.outputs == direct.outputs
