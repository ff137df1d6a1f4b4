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
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

RUN_KEY_ENV = "SUPERNODE_RUN_KEY"  # this launcher's key, in its workers' environment
LAUNCHER_ENV = "SUPERNODE_LAUNCHER_PID"  # the process that may hold OUT's lock for the run
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
    from torch.distributed.elastic.multiprocessing.api import SignalException  # torch only when launching
    from torch.distributed.run import main as torchrun

    stopped_by = None
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
    code = take_recorded_code(out, key)
    if code:  # the workers' own outcome (a failure they recorded, or the interrupt they stopped on)
        return code
    return EXIT_OK if stopped_by is None else 128 + stopped_by


if __name__ == "__main__":
    sys.exit(main())
