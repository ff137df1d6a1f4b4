"""`supernode preview --stack prod --manifests DIR` through the real program (AWS side + workload)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from supernode.cli import main
from supernode.core.config import load_stack
from supernode.core.errors import EXIT_BAD_INPUT, EXIT_OK
from supernode.core.plan import build_plan
from supernode.tools import manifests as mf

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_preview_writes_manifests_that_all_validate(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    stale = out / "999-job-training-old.yaml"
    stale.write_text("kind: Job\n")
    # The repository's prod stack has no built images yet (placeholder digest, add-on tags): its image
    # policies would exit 1; this test is about the manifests, so they only warn here.
    lenient = tmp_path / "images-advisory.json"
    lenient.write_text('{"image-digests": "advisory", "image-placeholder": "advisory"}')
    assert (
        main(
            [
                "preview",
                "--stack",
                "prod",
                "--root",
                str(ROOT),
                "--json",
                "--manifests",
                str(out),
                "--policy-config",
                str(lenient),
            ]
        )
        == EXIT_OK
    )

    files = sorted(out.glob("*.yaml"))
    assert stale not in files, "an earlier run's manifests must not linger"
    manifests = [yaml.safe_load(f.read_text()) for f in files]
    assert len(manifests) == len(files) > 20
    cfg = load_stack("prod", ROOT)
    assert mf.validate(manifests, cfg.cluster.kubernetes_version) == []
    (job,) = [m for m in manifests if m["kind"] == "PyTorchJob"]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == build_plan("prod", cfg).nodes
    # apply order: namespaces and the CRD come before the objects that need them
    kinds = [m["kind"] for m in manifests]
    assert kinds.index("Namespace") < kinds.index("CustomResourceDefinition") < kinds.index("PyTorchJob")
    # the program's workload wiring (components/program.py) feeds the AWS outputs in
    pvs = [m for m in manifests if m["kind"] == "PersistentVolume"]  # FSx, for training and for serving
    assert pvs and all(
        pv["spec"]["csi"]["volumeHandle"]
        and pv["spec"]["csi"]["volumeAttributes"]["dnsname"].endswith(".amazonaws.com")
        for pv in pvs
    )


def test_preview_manifests_into_a_file_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert (
        main(["preview", "--stack", "dev", "--root", str(ROOT), "--json", "--manifests", str(not_a_dir)])
        == EXIT_BAD_INPUT
    )
    err = capsys.readouterr().err
    assert "--manifests" in err and str(not_a_dir) in err and "Traceback" not in err
