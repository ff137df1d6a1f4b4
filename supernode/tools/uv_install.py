"""Installs requirements with uv, honouring this machine's pip configuration.

uv is ~8x faster than pip here (issue 40: 0:55 vs 7:10 for requirements.txt into an empty venv), but it
reads none of pip's configuration: where pip takes the CPU build of torch from a find-links folder or a
local index, a bare `uv pip install torch==2.13.0` takes PyPI's CUDA build (5.3 GB instead of 2.0 GB).
So the indexes, find-links and constraints pip would use (`pip config list`: files and PIP_* variables)
are passed to uv as flags, and `--index-strategy unsafe-best-match` gives uv pip's semantics over several
indexes (the best version from any of them: the local `2.13.0+cpu` beats PyPI's `2.13.0`).

`--compile-bytecode`, pip's default that uv leaves out: without it every process compiles torch's
sources again (and nothing caches them where PYTHONDONTWRITEBYTECODE is set, as on our machines):
`import supernode.trainer.train` took 9.3 s instead of 3.5, and `make test`, which starts hundreds of
Python processes, 28 minutes instead of under 15. It costs ~37 s of install for the main venv.

Standard library only: the Makefile runs it as a script before the package is installed
(`python3 supernode/tools/uv_install.py --python .venv/bin/python -r requirements.txt`), and
`supernode serve-env` builds its commands from it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

# pip's option -> uv's flag; every value may hold several, whitespace-separated (pip's own rule).
PIP_TO_UV = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_config(python: str = sys.executable) -> dict[str, list[str]]:
    """The pip options of PIP_TO_UV as pip itself resolves them (config files, then PIP_* variables,
    later ones winning per key), read through `pip config list`; empty where pip is absent."""
    try:
        listing = subprocess.run(
            [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return parse_pip_config(listing)


def parse_pip_config(listing: str) -> dict[str, list[str]]:
    """`pip config list` lines (`global.find-links='/opt/wheels'`, `:env:.constraint='c.txt'`) as
    {option: values}; a later line for the same option replaces an earlier one, as in pip."""
    options: dict[str, list[str]] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        if sep and option in PIP_TO_UV:
            options[option] = shlex.split(value)[0].split() if value.strip() else []
    return options


def uv_flags(options: dict[str, list[str]]) -> list[str]:
    flags = [f"{PIP_TO_UV[option]}={value}" for option, values in options.items() for value in values]
    if options.get("extra-index-url") or options.get("find-links"):
        flags.append("--index-strategy=unsafe-best-match")  # pip's choice across indexes
    return flags


def find_uv() -> str | None:
    """uv beside this interpreter (the venv the Makefile installed it into), else on PATH."""
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.is_file() else shutil.which("uv")


def install_command(uv: str, python: str, args: list[str], options: dict[str, list[str]]) -> list[str]:
    return [uv, "pip", "install", "--python", python, "--compile-bytecode", *uv_flags(options), *args]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--python":
        print("usage: uv_install.py --python PYTHON PIP-INSTALL-ARGS...", file=sys.stderr)
        return 2
    python, args = argv[1], argv[2:]
    uv = find_uv()
    if uv is None:
        print("uv_install.py: no uv beside this Python or on PATH (the Makefile installs it first)", file=sys.stderr)
        return 2
    cmd = install_command(uv, python, args, pip_config())
    print(shlex.join(cmd), flush=True)
    return subprocess.run(cmd, env={**os.environ, "UV_NO_PROGRESS": "1"}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
