"""ruff, as `make test` runs it: the tree is formatted (`ruff format --check`) and lint-clean
(`ruff check`, rules in pyproject.toml). A failure prints what to run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = [sys.executable, "-m", "ruff"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*RUFF, *args], cwd=ROOT, capture_output=True, text=True, check=False)


def test_the_tree_is_formatted():
    r = _ruff("format", "--check", ".")
    assert r.returncode == 0, f"run `ruff format .`:\n{r.stdout}{r.stderr}"


def test_the_tree_is_lint_clean():
    r = _ruff("check", ".")
    assert r.returncode == 0, f"run `ruff check --fix .` and fix the rest:\n{r.stdout}{r.stderr}"
