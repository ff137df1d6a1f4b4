"""Every command that reads a stack file, against every class of bad stack file; and every other file
input against the classes that apply to it (issue 30: "a test walks every command x every bad-input
class"). Each case must end with exit 2 and a message naming the file, never a traceback, an
"internal error" or a wait on a pipe that no one writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supernode.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEV = (ROOT / "Pulumi.dev.yaml").read_text()


def _alias_bomb() -> str:
    text = "config:\n  supernode:region: us-east-1\n  x:a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for i in range(8):
        text += f"  x:{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n"
    return text


# class -> how to make the bad stack file at `path`, and a phrase its message must contain
STACK_FILES = {
    "missing": (lambda path: None, "stack file not found"),
    "directory": (lambda path: path.mkdir(), "is a directory"),
    "pipe": (lambda path: os.mkfifo(path), "is not a regular file"),
    "not-utf8": (lambda path: path.write_bytes(DEV.encode() + b"\n# \xff\xfe\n"), "not UTF-8"),
    "yaml-syntax": (lambda path: path.write_text("config:\n  supernode:region: [us-east-1\n"), "not valid YAML"),
    "alias-bomb": (lambda path: path.write_text(_alias_bomb()), "aliases (*name) are not accepted"),
    "duplicate-key": (lambda path: path.write_text(DEV + "  supernode:region: us-west-2\n"), "duplicate key"),
    "bool-for-int": (
        lambda path: path.write_text(DEV.replace("      nodes: 2\n", "      nodes: true\n", 1)),
        "Input should be a valid integer",
    ),
    "empty-value": (  # issue 31: YAML's null for `key:` with nothing after it, said as such
        lambda path: path.write_text(DEV.replace("  supernode:region: us-east-1\n", "  supernode:region:\n", 1)),
        "supernode:region: has no value",
    ),
    "instance-type-typo": (  # issue 31: the closest catalog names, not the whole catalog
        lambda path: path.write_text(DEV.replace("instanceType: p5.48xlarge", "instanceType: p5.48xlrge", 1)),
        "did you mean 'p5.48xlarge'",
    ),
    "beyond-bound": (
        lambda path: path.write_text(DEV.replace("    layers: 12\n", "    layers: 1000000000000000\n", 1)),
        "less than or equal to 1024",
    ),
}


# Each command that reads a stack, with the other arguments it requires (paths that exist).
COMMANDS = {
    "plan": lambda tmp: ["plan"],
    "preview": lambda tmp: ["preview"],
    "policy config": lambda tmp: ["policy", "config"],
    "preflight": lambda tmp: ["preflight"],
    "verify": lambda tmp: ["verify"],
    "train": lambda tmp: ["train", "--local", "--out", str(tmp / "out")],
    "export": lambda tmp: ["export", "--checkpoint", str(_dir(tmp / "ck")), "--out", str(tmp / "export")],
    "serve": lambda tmp: ["serve", "--local", "--model", str(_dir(tmp / "model"))],
    "data push": lambda tmp: ["data", "push", str(_dir(tmp / "data")), "--bucket", "b"],
    "model push": lambda tmp: ["model", "push", str(_dir(tmp / "model")), "--bucket", "b"],
    "drill restore": lambda tmp: ["drill", "restore", "--bucket", "b"],
}


def _dir(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    return path


@pytest.mark.parametrize("bad", list(STACK_FILES))
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_every_bad_stack_file(tmp_path, capsys, command, bad):
    make, phrase = STACK_FILES[bad]
    path = tmp_path / "Pulumi.bad.yaml"
    make(path)
    code = main([*COMMANDS[command](tmp_path), "--config", str(path)])
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert str(path) in err and phrase in err, err
    assert "Traceback" not in out + err and "internal error" not in err


def _not_utf8(path: Path) -> Path:
    path.write_bytes(b"text \xff\xfe more")
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


# The other file inputs: (argv for a bad file at `tmp`, a phrase the message must contain).
OTHER_INPUTS = {
    "policy check --resources: missing": (
        lambda tmp: ["policy", "check", "--resources", str(tmp / "none.json")],
        "file not found",
    ),
    "policy check --resources: pipe": (
        lambda tmp: ["policy", "check", "--resources", str(_fifo(tmp / "r.json"))],
        "is not a regular file",
    ),
    "policy check --resources: directory": (
        lambda tmp: ["policy", "check", "--resources", str(_dir(tmp / "r"))],
        "is a directory",
    ),
    "policy check --resources: not UTF-8": (
        lambda tmp: ["policy", "check", "--resources", str(_not_utf8(tmp / "r.json"))],
        "not UTF-8",
    ),
    "data prepare --corpus: missing": (
        lambda tmp: ["data", "prepare", "--corpus", str(tmp / "none.txt"), "--out", str(tmp / "d")],
        "not found",
    ),
    "data prepare --corpus: pipe": (
        lambda tmp: ["data", "prepare", "--corpus", str(_fifo(tmp / "c.txt")), "--out", str(tmp / "d")],
        "is not a regular file",
    ),
    "data prepare --corpus: directory": (
        lambda tmp: ["data", "prepare", "--corpus", str(_dir(tmp / "c")), "--out", str(tmp / "d")],
        "is not a regular file",
    ),
    "data prepare --corpus: not UTF-8": (
        lambda tmp: ["data", "prepare", "--corpus", str(_not_utf8(tmp / "c.txt")), "--out", str(tmp / "d")],
        "not UTF-8",
    ),
    "data verify --data: missing": (lambda tmp: ["data", "verify", str(tmp / "none")], "run `supernode data prepare`"),
    "serve --model: no export": (
        lambda tmp: ["serve", "--stack", "dev", "--root", str(ROOT), "--local", "--model", str(_dir(tmp / "m"))],
        "no manifest.json",
    ),
}


@pytest.mark.parametrize("case", list(OTHER_INPUTS))
def test_every_other_file_input_refuses_its_bad_inputs(tmp_path, capsys, case):
    argv, phrase = OTHER_INPUTS[case]
    code = main(argv(tmp_path))
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert phrase in err and str(tmp_path) in err, err
    assert "Traceback" not in out + err and "internal error" not in err
