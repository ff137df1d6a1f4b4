"""`supernode init` (issue 31, group 6): a pip install has the program but no Pulumi project; init writes
one (Pulumi.yaml, __main__.py, a starter stack) that plan and preview accept as it is, and never
replaces a user's file without --force."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import yaml

from supernode.cli import main
from supernode.cli.commands.init import TEMPLATE_STACK

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_starter_stack_is_the_repositorys_dev_stack():
    assert TEMPLATE_STACK.read_text() == (ROOT / "Pulumi.dev.yaml").read_text(), (
        "supernode/cli/project/Pulumi.dev.yaml (shipped for `supernode init`) differs from Pulumi.dev.yaml: "
        "cp Pulumi.dev.yaml supernode/cli/project/"
    )


def test_init_writes_a_project_plan_and_preview_accept(tmp_path, capsys):
    project = tmp_path / "my-cluster"  # does not exist yet
    assert main(["init", "--root", str(project)]) == 0
    assert sorted(p.name for p in project.iterdir()) == ["Pulumi.dev.yaml", "Pulumi.yaml", "__main__.py"]
    out = capsys.readouterr().out
    assert f"supernode preview --stack dev --root {project}" in " ".join(out.split())

    ours, repo = (
        yaml.safe_load((project / "Pulumi.yaml").read_text()),
        yaml.safe_load((ROOT / "Pulumi.yaml").read_text()),
    )
    assert ours["name"] == repo["name"] and ours["runtime"]["name"] == repo["runtime"]["name"] == "python"
    assert ours["config"] == repo["config"]
    # the program runs in the interpreter this package is installed in (tests run in a venv)
    assert ours["runtime"]["options"]["virtualenv"] == sys.prefix
    main_py = ast.parse((project / "__main__.py").read_text())
    imports = [n for n in main_py.body if isinstance(n, ast.ImportFrom)]
    assert [(i.module, [a.name for a in i.names]) for i in imports] == [("supernode.components.program", ["main"])]

    assert main(["plan", "--stack", "dev", "--root", str(project), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 16
    assert main(["preview", "--stack", "dev", "--root", str(project), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not [v for v in doc["policy"]["violations"] if v["enforcement"] == "mandatory"]


def test_init_names_another_stack(tmp_path):
    assert main(["init", "--root", str(tmp_path), "--stack", "prod-us"]) == 0
    assert (tmp_path / "Pulumi.prod-us.yaml").read_text() == TEMPLATE_STACK.read_text()


def test_existing_files_are_kept_unless_force(tmp_path, capsys):
    (tmp_path / "__main__.py").write_text("print('mine')\n")
    assert main(["init", "--root", str(tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / '__main__.py'}: exists; pass --force" in err
    # nothing written: not the one in the way, nor the others
    assert sorted(p.name for p in tmp_path.iterdir()) == ["__main__.py"]
    assert (tmp_path / "__main__.py").read_text() == "print('mine')\n"

    assert main(["init", "--root", str(tmp_path), "--force"]) == 0
    assert "supernode.components.program" in (tmp_path / "__main__.py").read_text()
    assert (tmp_path / "Pulumi.yaml").is_file() and (tmp_path / "Pulumi.dev.yaml").is_file()


def test_bad_root_and_stack_are_named(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["init", "--root", str(target)]) == 2
    assert f"--root {target}: {target} is a file, not a directory" in " ".join(capsys.readouterr().err.split())
    assert main(["init", "--root", str(tmp_path / "p"), "--stack", "dev/x"]) == 2
    assert "--stack 'dev/x': a stack name is letters" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
