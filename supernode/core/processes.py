"""Child processes die with their parent: a killed `supernode data prepare` or `supernode serve` must
not leave tokenizing workers (~400 MB each), a vLLM server (~3 GB) or training workers running,
reparented to init. The one copy of the rule: data prepare, serve, `supernode train`'s launcher and
the torchrun workers all call it.

`die_with_parent()` runs in the child (a pool initializer, a Popen `preexec_fn`, a torchrun worker): on Linux it asks
the kernel for SIGKILL when the parent dies (prctl PR_SET_PDEATHSIG), then checks that the parent
has not already gone in between. Elsewhere it does nothing (the process group still lets the parent
stop its children on a signal it can handle).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """Be killed when the process that started this one dies. `parent`: its PID where the caller
    knows it (a preexec_fn runs after the fork, where os.getppid() already is that parent)."""
    if not sys.platform.startswith("linux"):
        return
    expected = parent if parent is not None else os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # no such call (a seccomp sandbox): the process group is the remaining guard
    # The parent died before the request (this process was reparented): nothing will send the signal.
    # Never "the parent is PID 1": in a container the launcher is PID 1, and its workers its children.
    if os.getppid() != expected:
        os._exit(1)


def exit_on_sigterm() -> None:
    """Exit (status 0) on SIGTERM. A container's command is PID 1 of its PID namespace, and the kernel
    delivers PID 1 no signal it has no handler for, SIGTERM included: without one, every stop of a
    pod (a drain, a rollout) waits out the grace period and ends in SIGKILL. For loops whose work is
    safe to cut between rounds (the node agent and inventory DaemonSets)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
