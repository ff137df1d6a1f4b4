"""The local backend of `supernode job` (supernode.tools.jobs_local): for real where it matters.

The slow tests run the real runner process and the real trainer (torchrun + gloo, the dev stack's
local run): preemption by priority with a checkpoint, the requeue and the resume to the loss of an
uninterrupted run; a runner killed with SIGKILL and started again without losing its job; cancel of
a queued and of a running job. The quick ones drive the store and the admission rule in-process
(`tick()` with the process start replaced by a record of it): who is admitted, who is preempted.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supernode.core.config import load_stack
from supernode.core.errors import BadInput, ConfigError
from supernode.core.jobs import job_from_mapping
from supernode.core.outdir import OutDirLock
from supernode.tools.jobs_local import LocalBackend, local_job_plan

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "supernode"]


def job(name: str, priority: str = "normal", steps: int = 30, **training):
    return job_from_mapping(
        {
            "name": name,
            "team": "research",
            "priority": priority,
            "training": {"steps": steps, "checkpointInterval": 10, **training},
        }
    )


@pytest.fixture(scope="module")
def dev():
    return load_stack("dev", ROOT)


def submit(backend: LocalBackend, dev, spec, tmp_path: Path):
    path = tmp_path / f"{spec.name}.yaml"
    path.write_text(json.dumps(spec.model_dump(by_alias=True, exclude_defaults=True)))
    return backend.submit(spec, local_job_plan("dev", dev, spec), path, ["--stack", "dev", "--root", str(ROOT)])


# -- quick: the store and the admission rule -------------------------------------------------------


class Recording(LocalBackend):
    """The runner's rule with its two effects recorded instead of done: starting a job's process and
    sending one SIGTERM."""

    def __init__(self, home: Path):
        super().__init__(home, start_runner=False)
        self.started: list[str] = []
        self.stopped: list[tuple[str, str]] = []

    def _start(self, con, row) -> None:
        self.started.append(row["name"])
        con.execute("UPDATE jobs SET state = 'running', attempts = attempts + 1 WHERE name = ?", (row["name"],))

    def _stop(self, name: str, by: str) -> None:
        self.stopped.append((name, by))

    def _reap(self) -> None:
        pass


def test_admission_is_by_priority_then_submission_order_and_preempts_the_lowest(tmp_path, dev):
    b = Recording(tmp_path / "home")
    for spec in (job("a", "low"), job("b", "normal"), job("c", "low")):
        submit(b, dev, spec, tmp_path)
    assert [s.queue_position for s in b.list()] == [2, 1, 3]  # normal first, then the lows in order
    b.tick()
    assert b.started == ["b"]  # 2 processes: one job at a time (the dev stack's local.nproc)
    assert b.describe("a").queue_position == 1 and b.describe("b").state == "running"

    submit(b, dev, job("d", "high"), tmp_path)
    b.tick()
    assert b.stopped == [("b", "d")]  # the running normal job is asked to stop for the high one
    assert b.describe("b").state == "preempting" and "preempted by d" in b.describe("b").message
    b.tick()
    assert b.started == ["b"] and b.stopped == [("b", "d")]  # nothing admitted while b frees its processes

    submit(b, dev, job("e", "normal"), tmp_path)
    b.tick()  # a normal job cannot preempt b, which is already stopping; no second SIGTERM
    assert b.stopped == [("b", "d")]


def test_equal_priority_does_not_preempt(tmp_path, dev):
    b = Recording(tmp_path / "home")
    submit(b, dev, job("a", "high"), tmp_path)
    b.tick()
    submit(b, dev, job("b", "high"), tmp_path)
    b.tick()
    assert b.started == ["a"] and b.stopped == [] and b.describe("b").queue_position == 1


def test_two_submits_of_one_name(tmp_path, dev):
    b = LocalBackend(tmp_path / "home", start_runner=False)
    first = submit(b, dev, job("same"), tmp_path)
    again = submit(b, dev, job("same"), tmp_path)  # the same file again: nothing new
    assert again.state == first.state == "queued" and again.message.startswith("already submitted")
    assert len(b.list()) == 1
    with pytest.raises(BadInput, match=r"'same' is already in the local queue \(queued\) with another job file"):
        submit(b, dev, job("same", lr=0.001), tmp_path)
    assert b.describe("same").steps == 30  # the first one is untouched


def test_cancel_a_queued_job_and_unknown_names(tmp_path, dev):
    b = LocalBackend(tmp_path / "home", start_runner=False)
    submit(b, dev, job("q"), tmp_path)
    assert b.cancel("q").state == "cancelled"
    with pytest.raises(BadInput, match="has already ended \\(cancelled\\)"):
        b.cancel("q")
    with pytest.raises(BadInput, match="no job 'nope' in the local queue"):
        b.describe("nope")
    with pytest.raises(BadInput, match="no job 'nope'"):
        list(b.logs("nope"))


def test_a_corrupt_store_is_a_clear_error_and_is_left_in_place(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "jobs.db").write_bytes(b"not a database" * 100)
    with pytest.raises(BadInput, match="not a usable job store"):
        LocalBackend(home).list()
    assert (home / "jobs.db").read_bytes() == b"not a database" * 100  # nothing overwritten


def test_a_local_job_keeps_the_local_scale_and_validates_its_keys(dev):
    plan = local_job_plan("dev", dev, job("x", steps=12, lr=0.001))
    assert (plan.training.steps, plan.training.lr, plan.world_size) == (12, 0.001, dev.local.nproc)
    with pytest.raises(ConfigError) as e:
        local_job_plan("dev", dev, job("x", steps=12, warmupSteps=50))
    assert any("warmupSteps" in i.path for i in e.value.issues)
    with pytest.raises(BadInput, match="branch"):
        local_job_plan("dev", dev, job_from_mapping({"name": "x", "team": "t", "branch": {"fromRun": "r", "step": 1}}))


def test_list_reads_the_store_not_every_run(tmp_path, dev):
    """1,000 finished jobs: list answers from the store (their last figures were recorded when they
    ended), never opening 1,000 metrics files."""
    b = LocalBackend(tmp_path / "home", start_runner=False)
    for i in range(3):
        submit(b, dev, job(f"j{i}"), tmp_path)
    with sqlite3.connect(b.home / "jobs.db") as con:
        con.execute("UPDATE jobs SET state = 'succeeded', step = 30, loss = 2.5, last_checkpoint = 30")
    for i in range(3):
        (b.home / "jobs" / f"j{i}" / "runs").mkdir(parents=True)  # a run there must not be read
        (b.home / "jobs" / f"j{i}" / "runs" / f"j{i}").write_text("not a directory")
    statuses = b.list()
    assert [(s.state, s.step, s.loss, s.last_checkpoint) for s in statuses] == [("succeeded", 30, 2.5, 30)] * 3


# -- slow: the runner and the trainer for real ------------------------------------------------------


def cli(*args: str, home: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*CLI, "job", *args, "--home", str(home)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def job_file(tmp_path: Path, name: str, priority: str, steps: int) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nteam: research\npriority: {priority}\ntraining:\n  steps: {steps}\n  checkpointInterval: 10\n"
    )
    return path


def status(home: Path, name: str) -> dict:
    return json.loads(cli("describe", name, "--local", "--json", home=home).stdout)


def losses(home: Path, name: str) -> dict[int, float]:
    lines = (home / "jobs" / name / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if isinstance(r.get("loss"), float)}


@pytest.mark.slow
def test_a_high_priority_job_preempts_a_low_one_which_resumes_to_the_uninterrupted_loss(tmp_path):
    home, alone = tmp_path / "home", tmp_path / "alone"
    # 40 steps: preempted at step 5 or soon after, low has 35 left to spare
    low, high = job_file(tmp_path, "low", "low", 40), job_file(tmp_path, "high", "high", 20)
    # The reference: the same job file, never interrupted.
    cli("submit", "--stack", "dev", "--local", str(low), home=alone)
    cli("wait", "low", "--local", home=alone)

    t0 = time.monotonic()
    out = cli("submit", "--stack", "dev", "--local", str(low), home=home).stdout
    assert "started the local runner" in out
    cli("wait", "low", "--local", "--state", "running", "--step", "5", home=home)
    assert time.monotonic() - t0 < 120
    cli("submit", "--stack", "dev", "--local", str(high), home=home)
    cli("wait", "high", "low", "--local", home=home)

    lo, hi = status(home, "low"), status(home, "high")
    assert (lo["state"], hi["state"]) == ("succeeded", "succeeded")
    assert (lo["preemptions"], lo["attempts"], hi["preemptions"], hi["attempts"]) == (1, 2, 0, 1)
    log = (home / "jobs" / "low" / "log").read_text()
    stopped = int(log.split("SIGTERM: stopped after step ")[1].split(" ")[0])
    assert f"SIGTERM: stopped after step {stopped} with a checkpoint" in log
    assert 5 <= stopped < 40 and f"resumed from checkpoint at step {stopped}" in log
    # high ran while low waited: it started after low stopped and ended before low resumed
    hi_log = (home / "jobs" / "high" / "log").read_text()
    assert "attempt 1" in hi_log and "attempt 2" in log
    assert losses(home, "low")[40] == pytest.approx(losses(alone, "low")[40], rel=1e-5)
    assert (lo["step"], lo["last_checkpoint"], lo["queue_position"]) == (40, 40, None)

    listed = json.loads(cli("list", "--local", "--json", home=home).stdout)
    assert [j["name"] for j in listed] == ["low", "high"]
    logs = cli("logs", "low", "--local", home=home).stdout
    assert logs == log


@pytest.mark.slow
def test_a_killed_runner_loses_no_job_and_cancel_checkpoints_first(tmp_path):
    home = tmp_path / "home"
    first, second = job_file(tmp_path, "first", "normal", 400), job_file(tmp_path, "second", "normal", 20)
    cli("submit", "--stack", "dev", "--local", str(first), home=home)
    cli("submit", "--stack", "dev", "--local", str(second), home=home)
    cli("wait", "first", "--local", "--state", "running", "--step", "5", home=home)
    assert status(home, "second")["queue_position"] == 1

    runner, _ = OutDirLock.holder_pid(home)
    trainer, _ = OutDirLock.holder_pid(home / "jobs" / "first")
    os.kill(runner, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the trainer dies with its runner (PR_SET_PDEATHSIG)
        try:
            os.kill(trainer, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the job's trainer outlived its runner")

    before = status(home, "first")
    assert before["state"] == "running" and before["attempts"] == 1  # as the dead runner left it
    subprocess.Popen([*CLI, "job", "runner", "--home", str(home)], cwd=ROOT, start_new_session=True)
    log = home / "jobs" / "first" / "log"
    deadline = time.monotonic() + 120
    while "resumed from checkpoint at step " not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    resumed = int(log.read_text().split("resumed from checkpoint at step ")[1].split(";")[0])
    assert resumed <= before["step"]
    while (s := status(home, "first"))["step"] <= resumed + 5:  # training again, past its first logged step
        assert time.monotonic() < deadline, s
        time.sleep(0.2)
    assert s["state"] == "running" and s["attempts"] == 2 and s["preemptions"] == 0  # requeued and resumed

    cli("cancel", "second", "--local", home=home)  # queued: ends at once
    assert status(home, "second")["state"] == "cancelled"
    cancelled = json.loads(cli("cancel", "first", "--local", "--json", home=home).stdout)
    assert cancelled["state"] == "cancelling"
    cli("wait", "first", "--local", home=home)
    s = status(home, "first")
    assert s["state"] == "cancelled" and s["step"] < 400
    assert s["last_checkpoint"] == s["step"]  # it checkpointed the step it stopped at


def test_a_job_that_cannot_start_fails_alone_and_the_runner_goes_on(tmp_path, dev):
    b = LocalBackend(tmp_path / "home", slots=4, start_runner=False)
    submit(b, dev, job("broken"), tmp_path)
    (b.home / "data").mkdir()
    (b.home / "data" / "manifest.json").write_text("{}")  # prepared: nothing to tokenize here
    where = b.home / "jobs" / "broken"
    for f in where.iterdir():
        f.unlink()
    where.rmdir()
    where.write_text("a file where the job's directory was")
    assert b.tick() is True
    s = b.describe("broken")
    assert s.state == "failed" and s.message.startswith("could not start:") and "Not a directory" in s.message
    assert b.tick() is False and not b.children  # nothing left to run, nothing started
