"""Metrics: JSON lines, Prometheus text exposition, MFU against the catalog peak, plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from supernode.core.config import load_stack
from supernode.core.plan import build_local_plan
from supernode.trainer.metrics import JSONL, LOAD_PNG, LOSS_PNG, PROM, Metrics, load_imbalance, plot

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan():
    return build_local_plan("dev", load_stack("dev", ROOT))


def log(m: Metrics, step: int, loss: float, load: torch.Tensor):
    return m.log(
        step,
        loss=loss,
        lr=1e-3,
        grad_norm=0.5,
        tokens=2048,
        step_s=0.5,
        compute_s=0.3,
        comm_s=0.15,
        data_s=0.05,
        expert_load=load,
    )


def test_load_imbalance_is_max_over_mean_per_layer():
    counts = torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0], [0, 5, 10, 25]])
    assert load_imbalance(counts) == [1.0, 4.0, 2.5]


def test_jsonl_and_prometheus_contents(tmp_path, plan):
    m = Metrics(tmp_path, plan, world_size=2, device_type="cpu")
    log(m, 1, 5.5, torch.tensor([[8, 8, 8, 8]]))
    rec = log(m, 2, 4.0, torch.tensor([[20, 4, 4, 4]]))
    lines = [json.loads(x) for x in (tmp_path / JSONL).read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[1]["loss"] == 4.0
    assert lines[1]["tokens_per_s"] == pytest.approx(2048 / 0.5)
    # achieved FLOP/s per rank from the plan's FLOPs per token; no MFU on CPU (no catalog peak)
    assert lines[1]["flops_per_s_per_rank"] == pytest.approx(plan.flops_per_token * 4096 / 2)
    assert lines[1]["mfu"] is None
    assert lines[1]["expert_load_max_over_mean"] == [2.5]
    assert (lines[1]["compute_s"], lines[1]["comm_s"], lines[1]["data_s"]) == (0.3, 0.15, 0.05)
    assert rec.step == 2

    families = {f.name: f for f in text_string_to_metric_families((tmp_path / PROM).read_text())}
    value = {f"{f.name}{dict(s.labels)}": s.value for f in families.values() for s in f.samples}
    assert value["supernode_train_loss{}"] == 4.0
    assert value["supernode_train_step{}"] == 2
    assert value["supernode_train_phase_seconds{'phase': 'comm'}"] == 0.15
    assert value["supernode_train_expert_load_max_over_mean{'layer': '0'}"] == 2.5
    # the plan-drift ratio the alarm reads: measured step time over the plan's estimate
    assert value["supernode_train_step_time_over_plan{}"] == pytest.approx(0.5 / plan.step.step_s)
    assert "supernode_train_phase_seconds{'phase': 'checkpoint'}" not in value  # no save yet

    m.checkpoint_stall(0.25)  # the step's save blocked training this long: exported with the next step
    log(m, 3, 3.9, torch.tensor([[8, 8, 8, 8]]))
    families = {f.name: f for f in text_string_to_metric_families((tmp_path / PROM).read_text())}
    value = {f"{f.name}{dict(s.labels)}": s.value for f in families.values() for s in f.samples}
    assert value["supernode_train_phase_seconds{'phase': 'checkpoint'}"] == 0.25


def test_mfu_on_gpu_uses_the_catalog_peak(tmp_path, plan):
    m = Metrics(tmp_path, plan, world_size=2, device_type="cuda")
    rec = log(m, 1, 5.0, None)
    assert rec.mfu == pytest.approx(plan.flops_per_token * 4096 / 2 / plan.hardware.peak_flops)
    assert rec.expert_load_max_over_mean == []


def test_other_ranks_write_nothing(tmp_path, plan):
    m = Metrics(tmp_path / "r1", plan, world_size=2, device_type="cpu", rank=1)
    assert log(m, 1, 5.0, None) is None
    m.close(plots=True)
    assert not (tmp_path / "r1").exists()


def test_plots_are_pngs(tmp_path, plan):
    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu")
    for step, loss in enumerate((5.0, 4.0, 3.5), 1):
        log(m, step, loss, torch.tensor([[10, 2, 2, 2], [4, 4, 4, 4]]))
    m.close(plots=True)
    for name in (LOSS_PNG, LOAD_PNG):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty.jsonl").touch()
    assert plot(tmp_path / "empty.jsonl", tmp_path) == []


def test_a_resumed_run_replaces_the_records_after_its_checkpoint(tmp_path, plan):
    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu")
    for step in range(1, 6):
        log(m, step, 6.0 - step, None)
    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu", start_step=3)  # restarted from step 3
    log(m, 4, 1.5, None)
    lines = [json.loads(x) for x in (tmp_path / JSONL).read_text().splitlines()]
    assert [(x["step"], x["loss"]) for x in lines] == [(1, 5.0), (2, 4.0), (3, 3.0), (4, 1.5)]


def test_prometheus_http_endpoint_serves_the_same_gauges(tmp_path, plan):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu", prometheus_port=port)
    log(m, 7, 2.25, torch.tensor([[3, 1]]))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "supernode_train_loss 2.25" in body and "supernode_train_step 7.0" in body
    assert 'supernode_train_expert_load_max_over_mean{layer="0"} 1.5' in body


def test_checkpoint_age_gauges_follow_the_commits(tmp_path, plan, group):
    """The gauges are NaN before any checkpoint (no age to show), then the newest commit's time and
    step: an async save counts once committed, not when started; a restarted run shows it at once."""
    import time

    from supernode.core.checkpoints import COMPLETE
    from supernode.trainer.checkpoint import Checkpointer

    def gauges(m: Metrics) -> tuple[float, float]:
        return (
            m.registry.get_sample_value("supernode_train_last_checkpoint_timestamp_seconds"),
            m.registry.get_sample_value("supernode_train_last_checkpoint_step"),
        )

    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, keep=2, state={"model": torch.nn.Linear(4, 4)}, async_save=True)
    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu", checkpoints=root)
    assert all(v != v for v in gauges(m))  # NaN
    ckpt.save(1)
    ckpt.wait_for_staging()
    log(m, 1, 5.0, None)
    assert all(v != v for v in gauges(m))  # started, not committed (commits happen in poll / wait)
    t0 = time.time()
    ckpt.wait()  # the commit
    log(m, 2, 4.5, None)
    first = gauges(m)
    assert first == ((root / "step_00000001" / COMPLETE).stat().st_mtime, 1)
    assert t0 - 1 <= first[0] <= time.time()
    time.sleep(0.05)
    ckpt.save(2, sync=True)
    log(m, 3, 4.0, None)
    second = gauges(m)
    assert second[1] == 2 and second[0] > first[0]
    families = {f.name: f for f in text_string_to_metric_families((tmp_path / PROM).read_text())}
    assert families["supernode_train_last_checkpoint_step"].samples[0].value == 2  # scraped from the file too
    m.close()
    ckpt.close()
    resumed = Metrics(tmp_path, plan, world_size=1, device_type="cpu", start_step=3, checkpoints=root)
    assert gauges(resumed) == second
    resumed.close()
