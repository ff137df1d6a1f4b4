"""Serving on Trainium is refused (issue 27; docs/architecture.md, "Serving on Trainium"): a trn2 stack with an
`inference` section gets one line naming supernode:inference and why, exit 2 from every command that plans,
where before its serving pods asked for nvidia.com/gpu on Neuron nodes and never started. GPU stacks serve
as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from supernode.cli import main
from supernode.core.config import from_mapping, load_stack
from supernode.core.errors import BadInput
from supernode.core.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]


def trn2_with_inference() -> dict:
    """The trn2 stack file's config with dev's inference section (a user's first try)."""
    trn2 = yaml.safe_load((ROOT / "Pulumi.trn2.yaml").read_text())
    dev = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())
    return {"config": {**trn2["config"], "supernode:inference": dev["config"]["supernode:inference"]}}


def test_the_plan_refuses_serving_on_trainium_naming_the_key_and_why():
    data = load_stack("trn2", ROOT).to_mapping()
    data["inference"] = load_stack("dev", ROOT).to_mapping()["inference"]
    cfg = from_mapping(data, "trn2 + inference")
    with pytest.raises(BadInput) as e:
        build_plan("trn2", cfg)
    message = str(e.value)
    assert message.startswith("inference: serving on Trainium2 (trn2u.48xlarge) is not supported")
    assert "supernode:inference" in message and "vLLM Neuron plugin" in message and "nvidia.com/gpu" in message


@pytest.mark.parametrize("command", ["plan", "preview"])
def test_every_planning_command_exits_2_with_one_line(command, tmp_path, capsys):
    path = tmp_path / "Pulumi.trn2.yaml"
    path.write_text(yaml.safe_dump(trn2_with_inference()))
    assert main([command, "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "supernode:inference" in err


def test_gpu_stacks_still_serve_and_trn2_without_inference_plans():
    assert build_plan("dev", load_stack("dev", ROOT)).inference is not None
    assert build_plan("trn2", load_stack("trn2", ROOT)).inference is None
