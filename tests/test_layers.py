"""The layers point one way (docs/architecture.md §2): import-linter's contracts in .importlinter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from source_tree import stage

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """The real .importlinter over the package in `tree` (the checkout, or a staged copy)."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / ".importlinter"), "--no-cache"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
    )


def test_layer_contracts_are_kept():
    """As anyone runs it: `lint-imports` in the checkout (supernode/components, /trainer and /policies are
    links to the top-level directories, so grimp's walk of supernode/ finds them)."""
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 2 kept, 0 broken." in r.stdout


def test_a_backwards_import_breaks_the_contract(tmp_path):
    """The contract can fail: a staged tree whose core imports the CLI."""
    stage(tmp_path)
    (tmp_path / "supernode" / "core" / "backwards.py").write_text("from supernode.cli import main\n", encoding="utf-8")
    r = _lint(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "supernode.core.backwards -> supernode.cli" in r.stdout
    assert "Contracts: 0 kept, 2 broken." in r.stdout
