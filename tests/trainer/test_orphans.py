"""Issue 30 #8: a killed `data prepare` left its spawned tokenizing workers (~414 MB each) running
for minutes. Its pool's initializer now asks the kernel to kill each worker with the prepare."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# The prepare's own pool: spawn context, its initializer, a worker busy for a minute.
POOL = """
import multiprocessing as mp, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from supernode.trainer.data.prepare import _init
from supernode.trainer.data.tokenizer import byte_tokenizer
parent = os.getpid() if sys.argv[1] == "guarded" else None
pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_init, initargs=(byte_tokenizer(), parent))
print(pool.submit(os.getpid).result(), flush=True)
pool.submit(time.sleep, 60)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def worker_after_killing_its_parent(mode: str, wait_s: float) -> tuple[int, bool]:
    proc = subprocess.Popen([sys.executable, "-c", POOL, mode], stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + wait_s
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return worker, alive(worker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_prepare_worker_dies_with_the_prepare():
    worker, survived = worker_after_killing_its_parent("unguarded", 1.5)  # the control: what happened before
    try:
        assert survived, "without the parent-death signal the worker outlives a SIGKILLed parent"
    finally:
        if survived:
            os.kill(worker, signal.SIGKILL)
    assert worker_after_killing_its_parent("guarded", 10)[1] is False
