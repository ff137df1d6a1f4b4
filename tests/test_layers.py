"""The layers point one way (docs/architecture.md §2): import-linter's contracts in .importlinter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_layer_contracts_are_kept():
    r = _lint(ROOT / ".importlinter")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 2 kept, 0 broken." in r.stdout


def test_a_backwards_import_breaks_the_contract(tmp_path):
    """The contract can fail: the real .importlinter over a copy of the packages whose core imports the CLI."""
    for path in (ROOT / "supernode").rglob("*.py"):
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "supernode" / "core" / "backwards.py").write_text("from supernode.cli import main\n", encoding="utf-8")
    r = subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / ".importlinter"), "--no-cache"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "supernode.core.backwards -> supernode.cli" in r.stdout
    assert "Contracts: 0 kept, 2 broken." in r.stdout
