"""supernode.core.processes as a container runs it: PID 1 of its own PID namespace (unshare, root)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PID1 = ["unshare", "--pid", "--fork", "--mount-proc"]


@pytest.fixture(scope="module")
def pid_namespaces() -> None:
    if os.geteuid() != 0:
        pytest.skip("a PID namespace needs root (unshare --pid)")
    probe = subprocess.run([*PID1, "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode().strip()}")


def _as_pid_1(code: str) -> tuple[subprocess.Popen, int]:
    """`code` run by Python as PID 1 of a new PID namespace: (unshare, that Python's PID here), once it printed."""
    proc = subprocess.Popen([*PID1, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "pid 1"  # it is PID 1 there
    (child,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return proc, int(child)


def _terminated_within(proc: subprocess.Popen, pid: int, seconds: float) -> int | None:
    os.kill(pid, signal.SIGTERM)  # from outside the namespace, as the container runtime sends it
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            os.kill(pid, signal.SIGKILL)
            proc.wait()


def test_pid_1_exits_on_sigterm_only_with_the_handler(pid_namespaces):
    """The premise: PID 1 without a handler ignores SIGTERM (a pod's stop waits out its grace period);
    the DaemonSet loops install one (`exit_on_sigterm`) and exit 0 at once."""
    wait = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(30)"
    proc, pid = _as_pid_1(wait)
    time.sleep(0.5)
    assert _terminated_within(proc, pid, 2) is None  # ignored
    proc, pid = _as_pid_1("from supernode.core.processes import exit_on_sigterm; exit_on_sigterm(); " + wait)
    assert _terminated_within(proc, pid, 10) == 0
