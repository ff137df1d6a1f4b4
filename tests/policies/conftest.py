"""Fixtures for the policy tests (helpers live in policy_resources.py, importable by name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from policy_resources import ROOT, compliant_stack

from supernode.core.config import StackConfig, load_stack
from supernode.core.plan import Plan, build_plan


@pytest.fixture(scope="session")
def dev_cfg() -> StackConfig:
    return load_stack("dev", ROOT)


@pytest.fixture(scope="session")
def dev_plan(dev_cfg: StackConfig) -> Plan:
    return build_plan("dev", dev_cfg)


@pytest.fixture
def stack(dev_cfg: StackConfig, dev_plan: Plan) -> list[dict[str, Any]]:
    return compliant_stack(dev_cfg, dev_plan)


@pytest.fixture(scope="session")
def saved_dev_preview(tmp_path_factory) -> tuple[int, Path]:
    """`supernode preview --stack dev --json` as a user would save it for `supernode policy check`."""
    import contextlib
    import io
    import os

    from supernode.cli import main

    out, cwd = io.StringIO(), os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out):
            rc = main(["preview", "--stack", "dev", "--json"])
    finally:
        os.chdir(cwd)
    path = tmp_path_factory.mktemp("preview") / "dev.json"
    path.write_text(out.getvalue(), encoding="utf-8")
    return rc, path
