"""A complete package (issue 19, item 4): the wheel `pip install .` builds carries the Pulumi program,
the add-on manifests, the CRD and the corpus, so `supernode plan` and `supernode preview` work from
any directory with only the stack file in --root.

The wheel is built from a copy of the sources (nothing of the checkout's build state) and installed
with --no-deps into a fresh venv; that venv finds the third-party dependencies through a .pth line
pointing at the project venv's site-packages, whose own .pth files (the checkout's editable install)
are not processed, so what runs is the installed wheel: asserted, not assumed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "requirements.txt", "supernode")

pytestmark = pytest.mark.slow


def run(*cmd: str | Path, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    wheels = tmp / "wheels"
    r = run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--quiet",
        "--wheel-dir",
        wheels,
        src,
        cwd=tmp,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = wheels.glob("supernode-*.whl")

    venv = tmp / "venv"
    r = run(sys.executable, "-m", "venv", venv, cwd=tmp)
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    r = run(py, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", wheel, cwd=tmp)
    assert r.returncode == 0, r.stderr
    site = run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).stdout.strip()
    (Path(site) / "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_the_installed_wheel_is_what_runs(installed, tmp_path):
    code = (
        "import supernode, supernode.components.k8s.common as w, supernode.trainer.data.prepare as d, supernode.components.program as p; "
        "print(supernode.__file__); print(p.__file__); print(len(list(w.ADDON_DIR.glob('*.yaml'))), "
        "len(list(w.CRD_DIR.glob('*.yaml'))), len(d.DEFAULT_CORPUS))"
    )
    r = run(installed / "bin" / "python", "-c", code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    package, program, counts = r.stdout.splitlines()
    assert Path(package).is_relative_to(installed) and Path(program).is_relative_to(installed)
    assert Path(program).name == "program.py"
    # every add-on file and CRD schema of the source tree, and the shipped corpus, are in the wheel
    source = ROOT / "supernode" / "components"
    assert counts == f"{len(list((source / 'addons').glob('*.yaml')))} {len(list((source / 'crds').glob('*.yaml')))} 1"


def test_plan_and_preview_run_from_any_directory(installed, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy2(ROOT / "Pulumi.dev.yaml", project)  # a user's project: the stack file, nothing else
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cli = installed / "bin" / "supernode"

    r = run(cli, "plan", "--stack", "dev", "--root", project, "--json", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert '"world_size": 16' in r.stdout

    r = run(cli, "preview", "--stack", "dev", "--root", project, "--json", cwd=elsewhere)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    types = {res["type"] for res in doc["resources"]}
    assert {
        "aws:eks/cluster:Cluster",
        "aws:ecr/repository:Repository",
        "kubernetes:kubeflow.org/v1:PyTorchJob",
        "kubernetes:apiextensions.k8s.io/v1:CustomResourceDefinition",
    } <= types
    assert not [v for v in doc["policy"]["violations"] if v["enforcement"] == "mandatory"]

    out = tmp_path / "data"
    r = run(cli, "data", "prepare", "--out", out, cwd=elsewhere)  # the shipped corpus
    assert r.returncode == 0, r.stderr
    assert (out / "manifest.json").exists()
