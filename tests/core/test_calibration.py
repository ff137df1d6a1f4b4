"""A calibration (`bench gpu --calibration-out FILE`) replaces the planner's default efficiencies: read
from `supernode plan --calibration FILE` or the stack key `supernode:calibration`, recorded in the Plan
and named by `supernode plan` (issue 29)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from supernode.cli import main
from supernode.core import capacity as cap
from supernode.core.config import load_stack
from supernode.core.errors import BadInput
from supernode.core.plan import Plan, build_plan

ROOT = Path(__file__).resolve().parents[2]
# Made-up figures for the tests (not a measurement): an H100 at 40% of peak and NVLink at 80%.
H100_CAL = {
    "version": 1,
    "accelerator": "H100",
    "device": "NVIDIA H100 80GB HBM3",
    "measured_at": "2026-01-01T00:00:00+00:00",
    "matmul_efficiency": 0.4,
    "nvlink_efficiency": 0.8,
    "efa_efficiency": None,
    "measurements": [],
}


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_a_calibration_sets_the_efficiencies_the_step_time_uses(tmp_path):
    cfg = load_stack("prod", ROOT)
    cal = cap.Calibration.read(_write(tmp_path / "h100.json", H100_CAL))
    base, calibrated = build_plan("prod", cfg), build_plan("prod", cfg, cal)
    assert base.calibration is None and calibrated.calibration == cal
    assert cal.path == str(tmp_path / "h100.json")
    # compute at 40% instead of 55% of peak; all-to-all (NVLink+EFA here) slower on the 80% NVLink
    assert calibrated.step.compute_s == pytest.approx(base.step.compute_s * 0.55 / 0.4)
    assert calibrated.step.all_to_all_s > base.step.all_to_all_s
    # EFA was not measured: a group on EFA alone (dp_replicate over 2 domains) keeps its figure
    assert calibrated.step.replicate_s == pytest.approx(base.step.replicate_s)
    assert Plan.from_json(calibrated.to_json()) == calibrated  # the trainer and the policies read it back


def test_the_stack_key_names_a_file_relative_to_the_project(tmp_path):
    _write(tmp_path / "h100.json", H100_CAL)
    cfg = load_stack("prod", ROOT).model_copy(update={"calibration": "h100.json"})
    plan = build_plan("prod", cfg, root=tmp_path)
    assert plan.calibration is not None and plan.calibration.matmul_efficiency == 0.4
    with pytest.raises(BadInput, match=r"supernode:calibration .*missing.json: file not found"):
        build_plan("prod", cfg.model_copy(update={"calibration": "missing.json"}), root=tmp_path)


def test_a_calibration_of_another_gpu_is_refused(tmp_path):
    cal = cap.Calibration.read(_write(tmp_path / "b300.json", H100_CAL | {"accelerator": "B300"}))
    with pytest.raises(BadInput, match=r"measured on B300 .* but the plan's GPUs are H100 \(p5.48xlarge\)"):
        build_plan("prod", load_stack("prod", ROOT), cal)


@pytest.mark.parametrize(
    "content, said",
    [
        ("{not json", "cannot be read as JSON"),
        (json.dumps(H100_CAL | {"matmul_efficiency": 1.5}), "not a calibration: matmul_efficiency"),
        (json.dumps(H100_CAL | {"mfu": 0.4}), "not a calibration: mfu"),
    ],
)
def test_an_unusable_calibration_file_is_bad_input(tmp_path, content, said):
    (tmp_path / "cal.json").write_text(content)
    with pytest.raises(BadInput, match=said):
        cap.Calibration.read(tmp_path / "cal.json", "--calibration")


def test_plan_names_its_calibration(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    f = _write(tmp_path / "h100.json", H100_CAL)
    assert main(["plan", "--stack", "prod", "--root", str(ROOT), "--calibration", str(f)]) == 0
    out = capsys.readouterr().out
    assert f"calibrated by {f} (bench gpu on NVIDIA H100 80GB HBM3, 2026-01-01T00:00:00+00:00)" in out
    assert "compute at 40% of peak, NVLink at 80%; EFA not measured, at catalog bandwidth" in out
    assert "uncalibrated" not in out
    assert main(["plan", "--stack", "prod", "--root", str(ROOT), "--calibration", str(f), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"]["path"] == str(f)
    # the stack key, relative to --root
    doc = yaml.safe_load((ROOT / "Pulumi.prod.yaml").read_text())
    doc["config"]["supernode:calibration"] = "h100.json"
    (tmp_path / "Pulumi.cal.yaml").write_text(yaml.safe_dump(doc))
    assert main(["plan", "--stack", "cal", "--root", str(tmp_path)]) == 0
    assert f"calibrated by {tmp_path / 'h100.json'}" in capsys.readouterr().out
    assert main(["plan", "--stack", "prod", "--root", str(ROOT), "--calibration", str(tmp_path / "no.json")]) == 2
    assert "--calibration" in capsys.readouterr().err
