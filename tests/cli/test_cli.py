"""`supernode plan` / `supernode preview` per the command-line contract (docs/architecture.md §7)."""

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


def test_version_and_top_level_help(capsys):
    import pytest

    from supernode import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"supernode {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Mixture-of-Experts training on GPU supernode clusters" in out and "exit codes: 0 ok" in out
    assert "Each subcommand lives in" not in out  # not the developer docstring


def test_every_command_help_has_a_description_examples_and_exit_codes():
    from supernode.cli import EXAMPLES, _leaves, build_parser

    leaves = list(_leaves(build_parser()))
    assert {name for name, _, _ in leaves} == set(EXAMPLES)  # a new command needs its examples
    for name, parser, _ in leaves:
        text = parser.format_help()
        assert parser.description, name
        assert "examples:\n  supernode" in text or "examples:\n  pulumi" in text or "examples:\n  AWS_" in text, name
        assert "exit codes: 0 ok; 1" in text, name


def test_preview_prints_a_summary_by_default_and_the_tree_on_request(capsys, tmp_path):
    assert main(["preview", "--stack", "dev", "--root", str(ROOT), "--manifests", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    summary = captured.out
    assert "resources" in summary and "supernode plan: dev" in summary and "policy compliance" in summary
    assert "pulumi:pulumi:Stack" not in summary
    # The manifests' report sits after the result it describes, on stdout, not earlier on stderr.
    assert "Kubernetes manifests to" in summary.split("policy compliance")[1] and "manifests" not in captured.err
    assert main(["preview", "--stack", "dev", "--root", str(ROOT), "--tree"]) == 0
    assert "pulumi:pulumi:Stack" in capsys.readouterr().out


def test_an_output_path_under_a_file_is_bad_input(tmp_path, capsys):
    """A path a user gave that cannot be a directory: one line naming it, exit 2, in every command."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for argv in (
        ["train", "--stack", "dev", "--root", str(ROOT), "--local", "--out", str(blocker / "out"), "--steps", "1"],
        ["data", "prepare", "--out", str(blocker / "out")],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"error: {blocker / 'out'}: Not a directory" in err and "internal error" not in err


def test_emoji_codes_in_messages_stay_text(tmp_path, capsys):
    """Issue 30, also seen: rich printed `:x:` in an error message (here a path) as an emoji."""
    assert main(["plan", "--config", str(tmp_path / "Pulumi.:x:.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Pulumi.:x:.yaml" in err and "\u274c" not in err


def test_plan_says_its_figures_are_uncalibrated_and_on_what(capsys, monkeypatch):
    """Without a calibration the plan records none and says which assumption its figures rest on."""
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["plan", "--stack", "prod", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert "uncalibrated estimate" in out and "55% of the GPU's dense bf16 peak" in out
    assert "arXiv:2402.15627" in out and "NeMo AutoModel" in out  # the public sources of the default
    assert "--calibration-out" in out  # and how to measure instead
    assert main(["plan", "--stack", "prod", "--root", str(ROOT), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] is None


def test_plan_prints_the_step_as_the_sum_of_its_terms(capsys, monkeypatch):
    from supernode.core.plan import build_plan

    monkeypatch.setenv("COLUMNS", "400")
    assert main(["plan", "--stack", "prod", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    s = build_plan("prod", load_stack("prod", ROOT)).step
    assert (
        f"compute {s.compute_s:.3f} + recompute {s.recompute_s:.3f} + exposed all-to-all "
        f"{s.exposed_all_to_all_s:.3f} + exposed FSDP {s.exposed_fsdp_s:.3f} + TP {s.tensor_parallel_s:.3f} "
        f"= {s.step_s:.3f} s"
    ) in out
    assert f"all-to-all {s.all_to_all_s:.3f} (NVLink+EFA) + {s.recompute_all_to_all_s:.3f} recomputed" in out


def test_a_short_run_costs_minutes_not_zero_hours(capsys, monkeypatch):
    from supernode.core.plan import build_plan

    monkeypatch.setenv("COLUMNS", "400")
    plan = build_plan("dev", load_stack("dev", ROOT))
    assert plan.run_hours < 1  # 2000 steps of a small model
    assert main(["plan", "--stack", "dev", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert "~ 0.0 h" not in out and f"~ {plan.run_hours * 60:.1f} min ~ ${plan.run_cost_usd:,.2f} on demand" in out


def test_suggestions_print_their_micro_batch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    doc = yaml.safe_load((ROOT / "Pulumi.prod.yaml").read_text())
    doc["config"]["supernode:parallel"].update(dpReplicate=16, dpShard=8, ep=8, activationCheckpointing="none")
    doc["config"]["supernode:training"].update(microBatch=4)
    for group in doc["config"]["supernode:acceleratorNodeGroups"]:
        group["instanceType"] = "p4d.24xlarge"  # A100 40 GB: only a lower microBatch fits
    f = tmp_path / "Pulumi.big.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert main(["plan", "--config", str(f)]) == 1
    out = capsys.readouterr().out
    assert "none slower and larger than another" in out
    assert "microBatch 1 (" in out or "microBatch 2 (" in out
