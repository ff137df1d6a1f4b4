"""torchrun with the outcome classified: the trainer's entry point in the cluster's PyTorchJob and
under `supernode train --local`.

    python -m supernode.trainer.launch [torchrun flags] --module supernode.trainer.train --out DIR ...

Workers record a failure that a restart cannot fix (bad input, no space, divergence, no usable
checkpoint) for their launcher and, under a launcher, exit 0: torchrun then neither restarts them
onto the same fault nor prints a `ChildFailedError` traceback, and this launcher exits with the
recorded code (2 bad input, 1 failed, 130 interrupted). Any other failure (a lost peer, a killed
worker) keeps torchrun's elastic restarts and its exit status.

A record belongs to one launcher: each launcher draws a run key (SUPERNODE_RUN_KEY in its workers'
environment), the run's rank 0 learns every node's key when the process group forms and records
the outcome in OUT/.exit-<key>.json for each, and each launcher reads and removes only its own. A
second run refused on a busy OUT records under its own keys, never touching the holder's.

SIGTERM and SIGINT exit 128 + the signal (143, 130), without a traceback: with the PyTorchJob's
`restartPolicy: ExitCode` the operator restarts pods for those (128-255), never for a recorded
failure (1-127). Once torchrun has started the workers it forwards the signal and waits up to its
--shutdown-timeout (the PyTorchJob passes the pod's grace period) while they finish the step and
write a checkpoint; before that there is nothing to stop and the launcher exits at once.

A hang that never reaches a collective timeout (a stuck read, a deadlocked loader, a rank spinning
outside any collective) is a stall: each worker beats a heartbeat file (`Heartbeat`) when it reaches
a phase and after every step, and the launcher's `StallWatchdog` SIGKILLs a worker whose last beat
is older than training.stallRestartS. torchrun then treats it as a failed worker: it stops the
others and restarts them (one of --max-restarts), which resume from the newest checkpoint (a hung
step cannot checkpoint; the periodic and async ones are what a stall costs). Each stall is counted
in OUT/stalls.jsonl (the trainer's supernode_train_stall_restarts gauge reads it) and said in one
line on stderr.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

RUN_KEY_ENV = "SUPERNODE_RUN_KEY"  # this launcher's key, in its workers' environment
LAUNCHER_ENV = "SUPERNODE_LAUNCHER_PID"  # the process that may hold OUT's lock for the run
AGENT_ENV = "SUPERNODE_AGENT_PID"  # this process, torchrun's agent: the workers' parent, which they die with
HEARTBEAT_ENV = "SUPERNODE_HEARTBEAT_DIR"  # where this launcher's workers beat (a local directory it owns)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STALLS = "stalls.jsonl"  # OUT/: one line per stalled worker a launcher killed


def exit_file(out: Path, key: str) -> Path:
    """Where the outcome of the run launched under `key` is recorded (by supernode.trainer.train)."""
    return out / f".exit-{key}.json"


def out_dir(argv: list[str]) -> Path | None:
    """The trainer's --out among torchrun's arguments (the training script's come after --module NAME)."""
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--out="):
            return Path(arg.split("=", 1)[1])
    return None


def take_recorded_code(out: Path, key: str) -> int | None:
    """The exit code the workers recorded for this launcher, if any; the record goes with it."""
    path = exit_file(out, key)
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    code = rec.get("code") if isinstance(rec, dict) else None
    return code if isinstance(code, int) else None


class Heartbeat:
    """A worker's progress for its launcher's StallWatchdog: `beat(what)` rewrites the rank's file
    (atomically, so the watchdog never reads half of one) with what it last reached and how long it
    may take until the next beat. A no-op without a launcher (a bare torchrun or a test)."""

    def __init__(self, timeout_s: float):
        directory = os.environ.get(HEARTBEAT_ENV)
        self.path = Path(directory) / f"rank-{os.environ.get('RANK', '0')}.json" if directory else None
        self.timeout_s = timeout_s

    def beat(self, what: str) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"pid": os.getpid(), "what": what, "timeout_s": self.timeout_s}))
            tmp.replace(self.path)  # the new mtime is the beat
        except OSError:
            pass  # a heartbeat must not stop training; a worker that cannot beat is restarted as stalled

    def stop(self) -> None:
        """No more beats will come (the worker is finishing): nothing more to watch."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class StallWatchdog(threading.Thread):
    """Kills this launcher's workers whose heartbeat is older than the timeout they declared (the
    module docstring says why a kill and what follows); `stalls` counts them."""

    def __init__(self, directory: Path, out: Path, poll_s: float = 1.0):
        super().__init__(name="stall-watchdog", daemon=True)
        self.directory, self.out, self.poll_s = directory, out, poll_s
        self.stalls = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.poll_s):
            self.check(time.time())

    def stop(self) -> None:
        self._done.set()

    def check(self, now: float) -> list[dict]:
        """Kill each worker stalled at `now`; the records of those killed."""
        killed = []
        for path in sorted(self.directory.glob("rank-*.json")):
            try:
                beat = json.loads(path.read_text(encoding="utf-8"))
                silent_s = now - path.stat().st_mtime
                pid, timeout_s = int(beat["pid"]), float(beat["timeout_s"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # replaced or removed meanwhile: the next poll reads the new one
            if silent_s <= timeout_s:
                continue
            path.unlink(missing_ok=True)  # one kill per stall; the restarted worker beats afresh
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it ended meanwhile: nothing stalled
            self.stalls += 1
            rank = path.stem.removeprefix("rank-")
            record = {
                "time": now,
                "host": socket.gethostname(),
                "rank": rank,
                "pid": pid,
                "after": beat.get("what"),
                "silent_s": math.ceil(silent_s * 10) / 10,  # up, so a kill past 11 s never reads 11.0
                "timeout_s": timeout_s,
            }
            killed.append(record)
            try:
                with (self.out / STALLS).open("a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError:
                pass  # the count is lost, not the restart
            print(
                f"supernode.trainer.launch: rank {rank} (pid {pid}) made no progress for {silent_s:.0f} s after "
                f"{beat.get('what')} (training.stallRestartS = {timeout_s:g}): killed, so torchrun restarts the "
                f"workers from the newest checkpoint (counted in {self.out / STALLS})",
                file=sys.stderr,
                flush=True,
            )
        return killed


def stall_count(out: Path) -> int:
    """How many stalled workers the launchers of runs in `out` have killed (OUT/stalls.jsonl)."""
    try:
        return sum(1 for line in (out / STALLS).read_text(encoding="utf-8").splitlines() if line.strip())
    except (OSError, UnicodeDecodeError):
        return 0


def _exit_at_once(signum: int, frame) -> None:
    """No worker is running (torchrun has not started them, or they are done): nothing to stop, so
    exit now, 128 + the signal. A handler rather than the default action, which a container's PID 1
    does not get; os._exit, so no cleanup (a rendezvous in progress) can delay or swallow it."""
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    for sig in STOP_SIGNALS:  # Python's own SIGINT handler would end in a KeyboardInterrupt traceback
        signal.signal(sig, _exit_at_once)
    # `supernode train` starts this process with both signals blocked (so a Ctrl-C during Python's
    # start-up waits for the handlers above): one that came meanwhile is delivered now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    from supernode.core.errors import EXIT_BAD_INPUT, EXIT_OK

    argv = list(sys.argv[1:] if argv is None else argv)
    out = out_dir(argv)
    if out is None:
        print("error: supernode.trainer.launch needs the trainer's --out DIR among its arguments", file=sys.stderr)
        return EXIT_BAD_INPUT
    key = os.environ[RUN_KEY_ENV] = uuid.uuid4().hex  # fresh: no earlier run's record can match it
    os.environ.setdefault(LAUNCHER_ENV, str(os.getpid()))  # `supernode train` holds the lock itself
    os.environ[AGENT_ENV] = str(os.getpid())  # torchrun runs in this process: it starts the workers
    from torch.distributed.elastic.multiprocessing.api import SignalException  # torch only when launching
    from torch.distributed.run import main as torchrun

    stopped_by = None
    heartbeats = Path(tempfile.mkdtemp(prefix="supernode-heartbeat-"))
    os.environ[HEARTBEAT_ENV] = str(heartbeats)
    watchdog = StallWatchdog(heartbeats, out)
    watchdog.start()
    try:
        # torchrun installs its own handlers when it starts the workers: they raise SignalException
        # once the workers have stopped (or --shutdown-timeout passed). It raises ChildFailedError
        # (exit 1, torchrun's own report) when workers fail in a way they did not record.
        torchrun(argv)
    except SignalException as e:
        stopped_by = e.sigval
    finally:
        for sig in STOP_SIGNALS:  # the workers are done: a signal from here on ends this process at once
            signal.signal(sig, _exit_at_once)
        watchdog.stop()
        for path in heartbeats.iterdir():
            path.unlink(missing_ok=True)
        heartbeats.rmdir()
    code = take_recorded_code(out, key)
    if code:  # the workers' own outcome (a failure they recorded, or the interrupt they stopped on)
        return code
    return EXIT_OK if stopped_by is None else 128 + stopped_by


if __name__ == "__main__":
    sys.exit(main())
