"""Issue 31: messages name the directory, flag or key the user must change."""

from __future__ import annotations

from pathlib import Path

import pytest

from supernode.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEV = (ROOT / "Pulumi.dev.yaml").read_text()


def test_a_stack_not_found_names_the_directory_searched_and_root(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no --root: the current directory is searched
    (tmp_path / "Pulumi.prod.yaml").write_text(DEV)
    assert main(["plan", "--stack", "dev"]) == 2
    err = capsys.readouterr().err
    assert f"stack file not found in {tmp_path.resolve()} (it holds Pulumi.prod.yaml)" in err
    assert "pass --root DIR" in err and "Traceback" not in err
    assert main(["plan", "--stack", "dev", "--root", str(tmp_path / "elsewhere")]) == 2
    assert f"not found in {tmp_path.resolve() / 'elsewhere'} (it holds no Pulumi.*.yaml)" in capsys.readouterr().err


def test_a_config_file_not_found_names_its_directory(tmp_path, capsys):
    assert main(["plan", "--config", str(tmp_path / "Pulumi.x.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"stack file not found in {tmp_path.resolve()}" in err and "--root" not in err


@pytest.mark.parametrize(
    "broken,where",
    [
        (
            ('    publicAccessCidrs: ["203.0.113.0/24"]\n', '    publicAccessCidrs: ["203.0.113.0/24"\n'),
            "not valid YAML at line 11, column 3: expected ',' or ']', but got '<scalar>'",
        ),
        (
            ("      nodes: 2\n", "      nodes: 2\n    amiReleaseVersion 1.33\n"),
            "not valid YAML at line 22, column 24: could not find expected ':'",
        ),
    ],
)
def test_yaml_syntax_errors_keep_the_line_column_and_problem(tmp_path, capsys, broken, where):
    path = tmp_path / "Pulumi.bad.yaml"
    path.write_text(DEV.replace(*broken, 1))
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {where}" in err, err
    assert "(got None)" not in err


def test_an_empty_value_says_so_not_got_none(tmp_path, capsys):
    path = tmp_path / "Pulumi.bad.yaml"
    path.write_text(DEV.replace("  supernode:availabilityZone: us-east-1a\n", "  supernode:availabilityZone:\n"))
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "supernode:availabilityZone: has no value" in err and "(got None)" not in err


def test_an_instance_type_typo_gets_a_did_you_mean_not_the_catalog(tmp_path, capsys):
    path = tmp_path / "Pulumi.bad.yaml"
    path.write_text(DEV.replace("instanceType: p5.48xlarge", "instanceType: p5.48xlarg", 1))
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "supernode:acceleratorNodeGroups[0].instanceType: instance type is not in the accelerator catalog" in err
    assert "did you mean 'p5.48xlarge'" in err and "p4d.24xlarge" not in err
    path.write_text(DEV.replace("instanceType: p5.48xlarge", "instanceType: zz9", 1))
    assert main(["plan", "--config", str(path)]) == 2
    assert "the catalog (supernode/core/catalog.py) holds p4d.24xlarge, " in capsys.readouterr().err


def test_the_preview_table_is_not_cut_at_80_columns_outside_a_terminal(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    main(["preview", "--stack", "dev", "--root", str(ROOT)])  # capsys: stdout is not a terminal
    out = capsys.readouterr().out
    assert "…" not in out
    assert "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration" in out
