"""The training loop end to end under torchrun on gloo: clear errors, SIGKILL/SIGTERM recovery,
and resuming a checkpoint on another world size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supernode.cli import main as cli
from supernode.core.checkpoints import complete_checkpoints
from supernode.core.config import from_mapping, load_stack
from supernode.core.plan import Plan, build_local_plan
from supernode.core.runs import checkpoints_of, run_of
from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare
from supernode.trainer.engine import lr_factor

ROOT = Path(__file__).resolve().parents[2]


def local_plan(nproc: int, **training) -> Plan:
    """The dev stack's local plan at `nproc` ranks with training overrides (camelCase keys); short
    warmup unless given, so short test runs stay valid whatever the stack's own local section says."""
    data = load_stack("dev", ROOT).to_mapping()
    data["local"]["training"].update({"warmupSteps": 2, **training})
    cfg = from_mapping(data)
    return build_local_plan("dev", cfg, nproc)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens")
    prepare(DEFAULT_CORPUS, out, shard_tokens=1 << 16)
    return out


def write_plan(plan: Plan, path: Path) -> Path:
    path.write_text(plan.to_json())
    return path


def torchrun(plan_path: Path, data: Path, out: Path, nproc: int, *flags: str, restarts: int = 0) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        "-m",
        "supernode.trainer.train",
        "--plan",
        str(plan_path),
        "--data",
        str(data),
        "--out",
        str(out),
        *flags,
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_of(out) / "metrics.jsonl").read_text().splitlines())}


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        if (run_of(out) / "metrics.jsonl").exists() and max(losses(out), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def worker_pid(agent: int, local_rank: int) -> int:
    """The torchrun worker process with LOCAL_RANK = local_rank (a child of the agent)."""
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"LOCAL_RANK={local_rank}".encode() in env:
            return int(child)
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under torchrun {agent}")


def test_lr_schedule_warmup_then_decay_to_the_floor():
    plan = local_plan(2, steps=100, warmupSteps=10, schedule="cosine")
    f = lr_factor(plan.training)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(100) == pytest.approx(plan.training.min_lr_ratio) == f(500)
    linear = lr_factor(local_plan(2, steps=100, warmupSteps=0, schedule="linear").training)
    assert linear(50) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(local_plan(2, steps=100, warmupSteps=0, schedule="constant").training)(90) == 1.0


def test_plan_that_does_not_match_the_world_size_exits_2(tmp_path, data_dir):
    plan = write_plan(local_plan(2), tmp_path / "plan.json")
    env = dict(os.environ, WORLD_SIZE="3", RANK="0", LOCAL_RANK="0")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "supernode.trainer.train",
            "--plan",
            str(plan),
            "--data",
            str(data_dir),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2
    # a local plan of 2 ranks has elastic layouts for worlds 1 and 2 only
    assert "world size 3: the plan has no elastic layout for it (its worlds: 1, 2" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_plan_and_corrupt_data_exit_2(tmp_path, data_dir):
    (tmp_path / "bad.json").write_text('{"stack": "dev"}')
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "supernode.trainer.train",
            "--plan",
            str(tmp_path / "bad.json"),
            "--data",
            str(data_dir),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2 and "not a valid plan" in r.stderr and "Traceback" not in r.stderr


def test_cli_train_needs_local_and_a_valid_nproc(capsys):
    assert cli(["train", "--stack", "dev", "--root", str(ROOT)]) == 2
    assert "PyTorchJob" in capsys.readouterr().err
    assert cli(["train", "--stack", "dev", "--root", str(ROOT), "--local", "--nproc", "3"]) == 2
    assert "supernode:local.parallel.ep: ep must divide dpShard*tp (3*1 = 3)" in capsys.readouterr().err


def test_cli_data_prepare(tmp_path, capsys):
    assert (
        cli(
            [
                "data",
                "prepare",
                "--corpus",
                *map(str, DEFAULT_CORPUS),
                "--out",
                str(tmp_path),
                "--shard-tokens",
                "100000",
            ]
        )
        == 0
    )
    assert len(json.loads((tmp_path / "manifest.json").read_text())["shards"]) == 3
    assert cli(["data", "prepare", "--corpus", str(tmp_path / "nope.txt"), "--out", str(tmp_path)]) == 2
    assert "corpus file not found" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkill_mid_training_resumes_to_the_same_final_loss(tmp_path, data_dir):
    steps = 16
    plan = write_plan(local_plan(2, steps=steps, checkpointInterval=4, microBatch=8), tmp_path / "plan.json")
    reference = tmp_path / "reference"
    finish(torchrun(plan, data_dir, reference, 2))

    out = tmp_path / "killed"
    proc = torchrun(plan, data_dir, out, 2, restarts=1)
    wait_for_step(out, 7, proc)
    os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)
    log = finish(proc)
    assert "resumed from checkpoint at step" in log  # the restarted workers picked the checkpoint up
    resumed_at = int(log.split("resumed from checkpoint at step ")[1].split(";")[0])
    assert 4 <= resumed_at < steps
    assert losses(out)[steps] == pytest.approx(losses(reference)[steps], rel=1e-5)
    assert losses(out)[steps] < losses(out)[1] - 1.0  # it learned
    assert [s for s, _ in complete_checkpoints(checkpoints_of(out))][-1] == steps


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_stops(tmp_path, data_dir):
    plan = write_plan(local_plan(2, steps=500, checkpointInterval=100), tmp_path / "plan.json")
    out = tmp_path / "out"
    proc = torchrun(plan, data_dir, out, 2)
    wait_for_step(out, 3, proc)
    os.kill(worker_pid(proc.pid, 1), signal.SIGTERM)  # as Kubernetes does before evicting a pod
    log = finish(proc, timeout=120)
    ((stopped, _),) = complete_checkpoints(checkpoints_of(out))
    assert 3 <= stopped < 100 and f"SIGTERM: stopped after step {stopped}" in log


@pytest.mark.slow
def test_saved_at_world_size_4_resumed_at_2_gives_the_same_loss(tmp_path, data_dir):
    common = dict(steps=8, checkpointInterval=4, microBatch=4)
    plan4, plan2 = local_plan(4, **common), local_plan(2, **common)
    assert (plan4.degrees.dp_shard, plan2.degrees.dp_shard) == (4, 2)
    wide = tmp_path / "wide"
    finish(torchrun(write_plan(plan4, tmp_path / "plan4.json"), data_dir, wide, 4, "--steps", "6"))

    narrow = tmp_path / "narrow"
    (narrow / "checkpoints").mkdir(parents=True)
    (checkpoints_of(wide) / "step_00000004").rename(narrow / "checkpoints" / "step_00000004")
    log = finish(torchrun(write_plan(plan2, tmp_path / "plan2.json"), data_dir, narrow, 2, "--steps", "6"))
    assert "resumed from checkpoint at step 4" in log
    assert losses(narrow)[5] == pytest.approx(losses(wide)[5], rel=1e-4)
    # and one optimizer step later: the resharded Adam moments, schedule and router bias carried over
    assert losses(narrow)[6] == pytest.approx(losses(wide)[6], rel=1e-4)
    assert losses(narrow)[5] != pytest.approx(losses(wide)[1], rel=1e-2)  # really a later state


@pytest.mark.slow
def test_cluster_launcher_exits_with_the_recorded_code_without_restarts_or_traceback(tmp_path, data_dir):
    """The PyTorchJob's entry point: bad input under torchrun with restarts left is reported once,
    exit 2 (the ExitCode policy then does not restart the pod), no ChildFailedError traceback."""
    plan = write_plan(local_plan(2), tmp_path / "plan.json")  # a 2-rank plan on 3 ranks: bad input
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "supernode.trainer.launch",
            "--standalone",
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "2",
            "--module",
            "supernode.trainer.train",
            "--plan",
            str(plan),
            "--data",
            str(data_dir),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("world size 3: the plan has no elastic layout") == 1  # once: rank 0, no restart
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr
    assert not list((tmp_path / "out").glob(".exit*"))  # the record was this launcher's alone: it took it
