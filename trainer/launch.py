"""torchrun with the outcome classified: the trainer's entry point in the cluster's PyTorchJob.

    python -m trainer.launch [torchrun flags] --module trainer.train --out DIR ...

Workers record a failure that a restart cannot fix (bad input, no space, divergence, no usable
checkpoint) in OUT/.exit.json and, with this launcher's PID in their environment, exit 0: torchrun
then neither restarts them onto the same fault nor prints a `ChildFailedError` traceback, and this
launcher exits with the recorded code (2 bad input, 1 failed). Any other failure (a lost peer, a
killed worker) keeps torchrun's elastic restarts and its exit status. With the PyTorchJob's
`restartPolicy: ExitCode` the operator then restarts pods only for signals (exit 128-255), never for
a recorded failure. `supernode train --local` does the same from the CLI.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from supernode.core.errors import EXIT_BAD_INPUT, EXIT_OK

EXIT_FILE = ".exit.json"  # written by trainer.train's rank 0
LAUNCHER_ENV = "SUPERNODE_LAUNCHER_PID"


def out_dir(argv: list[str]) -> Path | None:
    """The trainer's --out among torchrun's arguments (the training script's come after --module NAME)."""
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--out="):
            return Path(arg.split("=", 1)[1])
    return None


def recorded_code(out: Path) -> int | None:
    """The exit code a worker recorded for this run, if any."""
    try:
        rec = json.loads((out / EXIT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    code = rec.get("code") if isinstance(rec, dict) else None
    return code if isinstance(code, int) else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = out_dir(argv)
    if out is None:
        print("error: trainer.launch needs the trainer's --out DIR among its arguments", file=sys.stderr)
        return EXIT_BAD_INPUT
    # A record from an earlier run must not decide this one. Every node's launcher removes it before
    # torchrun's rendezvous, which no worker passes until all nodes have joined.
    (out / EXIT_FILE).unlink(missing_ok=True)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    from torch.distributed.run import main as torchrun  # torch only when launching

    torchrun(argv)  # raises (exit 1, torchrun's own report) when workers fail in a way not recorded
    code = recorded_code(out)
    return EXIT_OK if code is None else code


if __name__ == "__main__":
    sys.exit(main())
