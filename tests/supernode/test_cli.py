"""`supernode plan` / `supernode preview` per the command-line contract (ARCHITECTURE.md §6)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from supernode.cli import main
from supernode.core.config import load_stack

ROOT = Path(__file__).resolve().parents[2]


def test_plan_json_contract(capsys):
    assert main(["plan", "--stack", "prod", "--root", str(ROOT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True
    assert out["world_size"] == 128
    assert set(out["degrees"]) == {"dp_replicate", "dp_shard", "tp", "ep", "pp"}
    assert out["memory_per_rank_gib"] < out["hbm_gib"] == 80.0


def test_plan_table(capsys):
    assert main(["plan", "--stack", "dev", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert "p5.48xlarge" in out and "fits" in out


def test_plan_that_does_not_fit_exits_1_with_suggestions(tmp_path, capsys):
    doc = yaml.safe_load((ROOT / "Pulumi.prod.yaml").read_text())
    doc["config"]["supernode:parallel"].update(dpReplicate=16, dpShard=8, ep=8, activationCheckpointing="none")
    doc["config"]["supernode:training"].update(microBatch=4)
    f = tmp_path / "Pulumi.big.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert main(["plan", "--config", str(f)]) == 1
    out = capsys.readouterr().out
    assert "does not fit: over by" in out and "Layouts with the same world size that fit" in out
    assert main(["plan", "--config", str(f), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["suggestions"]


def test_full_plan_json_is_what_the_trainer_reads(capsys):
    from supernode.core.plan import Plan

    assert main(["plan", "--stack", "dev", "--root", str(ROOT), "--json", "--full"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.model == load_stack("dev", ROOT).model
