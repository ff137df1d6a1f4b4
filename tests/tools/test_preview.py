"""Offline preview: the program (components/program.py) under Pulumi's mock engine records the stack's resources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supernode.cli import main
from supernode.core import resource_types as T
from supernode.core.config import load_stack
from supernode.tools.preview import run_program

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_preview_records_resources_with_parents(stack):
    result = run_program(stack, load_stack(stack, ROOT))
    assert len(result.resources) > 20
    urns = {r.urn for r in result.resources}
    stack_urn = f"urn:pulumi:{stack}::supernode::pulumi:pulumi:Stack::supernode-{stack}"
    for r in result.resources:
        assert r.parent in urns or r.parent == stack_urn, f"{r.urn} has unknown parent {r.parent}"
        assert r.urn.endswith(f"::{r.name}") and r.type in r.urn
    # every component resource (ours) has children: components parent what they create
    components = {r.urn for r in result.resources if r.type.startswith("supernode:")}
    assert components and components <= {r.parent for r in result.resources}
    assert result.outputs["plan"]["world_size"] == load_stack(stack, ROOT).accelerators


def test_preview_is_repeatable_in_one_process():
    """Runtime state is reset between runs: the same stack twice gives the same resources."""
    cfg = load_stack("dev", ROOT)
    a, b = run_program("dev", cfg), run_program("dev", cfg)
    assert [r.urn for r in a.resources] == [r.urn for r in b.resources]


def test_preview_json_contract(capsys):
    code = main(["preview", "--stack", "dev", "--root", str(ROOT), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 1)
    assert set(data) >= {"stack", "plan", "resources", "policy"}
    assert data["plan"]["fits"] is True
    r = data["resources"][0]
    assert set(r) >= {"urn", "type", "name", "parent", "inputs"}
    assert isinstance(data["policy"]["violations"], list)
    assert any(x["type"] == T.LAUNCH_TEMPLATE for x in data["resources"])
    assert data["outputs"]["kubeconfig"] == "[secret]"  # exported as a secret: masked like the Pulumi CLI does
    assert data["outputs"]["cluster_name"] == "supernode-dev"
