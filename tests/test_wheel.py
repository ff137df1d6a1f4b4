"""What a new user gets from `pip install` (issues 19 and 31): the wheel, installed into a clean venv with
its dependencies resolved from the wheel's own metadata (pyproject.toml) alone, runs `plan`, `preview`,
`data prepare`, `train --local`, `export` and `init` from a directory outside the checkout. A runtime import
that pyproject does not declare fails here (`internal error: ModuleNotFoundError`), as it would for the user:
nothing of the project venv is visible to the clean one.

The wheel is built from a copy of the sources (nothing of the checkout's build state). It is installed with
uv given pip's configuration, as the Makefile installs (issue 40: the pip install and the uncompiled imports
after it took 66 + 70 s of this module's 165; uv, byte-compiled, 53 + 36 of 107), so its dependencies come
from pip's configured indexes and find-links: on this project's machines those hold torch's CPU build, which
a plain `torch==2.13.0` resolves to (elsewhere, install torch's CPU build first, as the README says). `pip
check` then confirms every requirement is satisfied.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from source_tree import PACKAGE_DIRS

from supernode.tools.uv_install import find_uv, install_command, pip_config

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", *(d.name for d in PACKAGE_DIRS.values()))

pytestmark = pytest.mark.slow


def run(*cmd: str | Path, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    # nothing of this process's environment points the clean venv at the project's packages
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    wheels = tmp / "wheels"
    r = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, src, cwd=tmp)
    assert r.returncode == 0, r.stderr
    (built,) = wheels.glob("supernode-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("clean") / "venv"
    r = run(sys.executable, "-m", "venv", venv, cwd=venv.parent)
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    started = time.monotonic()
    # uv with pip's configuration, as the Makefile installs (supernode/tools/uv_install.py), resolving the
    # wheel's own requirements; byte-compiled, or each process below would compile torch's sources again
    r = run(*install_command(find_uv(), str(py), [str(wheel)], pip_config()), cwd=venv.parent, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"\nwheel install with its dependencies: {time.monotonic() - started:.0f} s")
    r = run(py, "-m", "pip", "check", cwd=venv.parent)  # every installed requirement satisfied
    assert r.returncode == 0, r.stdout
    return venv


def test_the_wheel_puts_only_supernode_in_site_packages(wheel):
    with zipfile.ZipFile(wheel) as z:
        (record,) = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
        entries = [line.split(",")[0] for line in z.read(record).decode().splitlines() if line]
    top = {e.split("/")[0] for e in entries}
    assert top == {"supernode", record.split("/")[0]}, sorted(top)
    assert record.startswith("supernode-") and not any(e.startswith("tests/") for e in entries)


def test_the_wheel_carries_the_management_pages_templates_and_assets(wheel):
    shipped = {p.relative_to(ROOT / "supernode") for p in (ROOT / "supernode/tools/ui_files").rglob("*") if p.is_file()}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert shipped and {f"supernode/{p}" for p in shipped} <= names, sorted(shipped)


def test_the_installed_wheel_is_what_runs(installed, tmp_path):
    code = (
        "import supernode, supernode.components.k8s.common as w, supernode.trainer.data.prepare as d, "
        "supernode.components.program as p, supernode.tools.serve as s, supernode.cli.commands.init as i; "
        "print(supernode.__file__); print(p.__file__); print(len(list(w.ADDON_DIR.glob('*.yaml'))), "
        "len(list(w.CRD_DIR.glob('*.yaml'))), len(d.DEFAULT_CORPUS), s.SERVE_REQUIREMENTS.is_file(), "
        "i.TEMPLATE_STACK.is_file())"
    )
    r = run(installed / "bin" / "python", "-c", code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    package, program, counts = r.stdout.splitlines()
    assert Path(package).is_relative_to(installed) and Path(program).is_relative_to(installed)
    assert Path(program).name == "program.py"
    # every add-on file and CRD schema of the source tree, the shipped corpus, the serving pins and the
    # starter stack are in the wheel
    source = ROOT / "components"
    addons, crds = len(list((source / "addons").glob("*.yaml"))), len(list((source / "crds").glob("*.yaml")))
    assert counts == f"{addons} {crds} 1 True True"
    # and nothing but pip's own files and the wheel's dependencies: no path into the project venv
    site = next((installed / "lib").glob("python3*/site-packages"))
    assert not [p for p in site.glob("*.pth") if str(ROOT) in p.read_text()]


def test_a_new_user_plans_previews_trains_and_exports_from_anywhere(installed, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy2(ROOT / "Pulumi.dev.yaml", project)  # a user's project: the stack file, nothing else
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cli = installed / "bin" / "supernode"
    stack = ["--stack", "dev", "--root", project]

    r = run(cli, "plan", *stack, "--json", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["world_size"] == 16

    r = run(cli, "preview", *stack, "--json", cwd=elsewhere)
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

    data = elsewhere / "data"
    r = run(cli, "data", "prepare", "--out", data, cwd=elsewhere)  # the shipped corpus
    assert r.returncode == 0, r.stderr
    assert (data / "manifest.json").is_file()

    out = elsewhere / "run"
    r = run(cli, "train", *stack, "--local", "--steps", "2", "--out", out, "--data", data, cwd=elsewhere)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [p.name for p in out.glob("runs/*/checkpoints/step_*")] == ["step_00000002"]  # one run

    model = elsewhere / "model"
    r = run(
        cli,
        "export",
        *stack,
        "--local",
        "--checkpoint",
        out,
        "--data",
        data,
        "--out",
        model,
        cwd=elsewhere,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((model / "manifest.json").read_text())
    assert manifest["architecture"] and any(name.endswith(".safetensors") for name in manifest["files"])
    assert not (elsewhere / "model.tmp").exists()


def test_init_gives_a_pip_install_a_pulumi_project(installed, tmp_path):
    project = tmp_path / "my-cluster"
    cli = installed / "bin" / "supernode"
    r = run(cli, "init", "--root", project, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # the program runs in the clean venv: the interpreter that has the package
    assert f"virtualenv: {installed}" in (project / "Pulumi.yaml").read_text()
    r = run(cli, "plan", "--stack", "dev", "--root", project, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run(cli, "serve-env", "--dry-run", cwd=tmp_path)  # the serving pins ship with the package
    assert r.returncode == 0, r.stderr
    assert "requirements-serve.txt" in r.stdout
