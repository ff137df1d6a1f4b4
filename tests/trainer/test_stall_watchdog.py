"""The launcher's stall watchdog (supernode.trainer.launch): a worker whose heartbeat is older than
the timeout it declared is killed and counted; a fresh one, a finished one and a torn file are not.
The end-to-end restart is test_failures.py::test_a_step_that_hangs_outside_any_collective_is_restarted_and_counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from supernode.trainer.launch import HEARTBEAT_ENV, STALLS, Heartbeat, StallWatchdog, stall_count


@pytest.fixture
def worker():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def beat_as(directory, monkeypatch, pid: int, rank: str, timeout_s: float, what: str = "step 7") -> Heartbeat:
    monkeypatch.setenv(HEARTBEAT_ENV, str(directory))
    monkeypatch.setenv("RANK", rank)
    hb = Heartbeat(timeout_s)
    hb.beat(what)
    rec = json.loads(hb.path.read_text())
    hb.path.write_text(json.dumps({**rec, "pid": pid}))  # as the worker process `pid` wrote it
    return hb


def test_a_silent_worker_is_killed_once_and_counted(tmp_path, monkeypatch, worker):
    beats, out = tmp_path / "beats", tmp_path / "out"
    beats.mkdir(), out.mkdir()
    hb = beat_as(beats, monkeypatch, worker.pid, "3", timeout_s=30)
    dog = StallWatchdog(beats, out)
    written = hb.path.stat().st_mtime
    assert dog.check(written + 29) == [] and worker.poll() is None  # within its timeout: left alone
    (killed,) = dog.check(written + 31)
    assert worker.wait(timeout=10) == -9
    assert killed["rank"] == "3" and killed["after"] == "step 7" and killed["silent_s"] == pytest.approx(31, abs=0.1)
    assert dog.check(written + 60) == []  # one kill per stall: the restarted worker beats afresh
    assert stall_count(out) == 1 and json.loads((out / STALLS).read_text())["pid"] == worker.pid


def test_a_worker_that_ended_or_a_torn_beat_is_not_a_stall(tmp_path, monkeypatch):
    beats, out = tmp_path / "beats", tmp_path / "out"
    beats.mkdir(), out.mkdir()
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    hb = beat_as(beats, monkeypatch, done.pid, "0", timeout_s=11)
    (beats / "rank-1.json").write_text('{"pid": 1')  # half a file: never written so (beats are atomic)
    assert StallWatchdog(beats, out).check(time.time() + 3600) == []
    assert stall_count(out) == 0
    hb.stop()
    assert not hb.path.exists()


def test_without_a_launcher_beats_are_a_no_op(tmp_path, monkeypatch):
    monkeypatch.delenv(HEARTBEAT_ENV, raising=False)
    hb = Heartbeat(60)
    hb.beat("start")
    hb.stop()
    assert hb.path is None and os.listdir(tmp_path) == []


def test_the_watchdog_thread_acts_on_its_own(tmp_path, monkeypatch, worker):
    beats, out = tmp_path / "beats", tmp_path / "out"
    beats.mkdir(), out.mkdir()
    hb = beat_as(beats, monkeypatch, worker.pid, "0", timeout_s=0.2)
    dog = StallWatchdog(beats, out, poll_s=0.05)
    dog.start()
    try:
        assert worker.wait(timeout=10) == -9
    finally:
        dog.stop()
        dog.join(timeout=5)
    assert dog.stalls == 1 and not hb.path.exists()
