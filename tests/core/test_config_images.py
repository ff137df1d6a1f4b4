"""supernode:images (issue 19): add-on images by name, pinned by tag or digest; the placeholder
trainer digest the stack files ship with; requireDigests, which sets the image policies' level."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import get_args

import pytest
import yaml

from supernode.cli import main
from supernode.components.k8s.addons import addon_images
from supernode.core.config import Images, load_stack
from supernode.core.config.schema import PLACEHOLDER_DIGEST, AddonImage

ROOT = Path(__file__).resolve().parents[2]
TRAINER = "123456789012.dkr.ecr.us-east-1.amazonaws.com/supernode-dev-trainer@sha256:" + "a" * 64
DIGEST = "@sha256:" + "c" * 64


def test_addon_names_are_the_containers_of_the_addon_files():
    assert set(get_args(AddonImage)) == set(addon_images())


def test_addons_accept_tags_and_digests():
    images = Images(trainer=TRAINER, addons={name: image + DIGEST for name, image in addon_images().items()})
    assert images.addons["dcgm-exporter"].endswith(DIGEST)
    assert Images(trainer=TRAINER, addons={"training-operator": "kubeflow/training-operator:v1.8.1"})
    assert Images(trainer=TRAINER).require_digests is False  # prod opts in (Pulumi.prod.yaml)


def test_both_stack_files_carry_the_known_placeholder():
    for stack in ("dev", "prod"):
        trainer = load_stack(stack, ROOT).images.trainer
        assert trainer.endswith("@" + PLACEHOLDER_DIGEST)
        assert trainer.split("@")[0].endswith(f"/supernode-{stack}-trainer")  # the stack's own ECR repository
    assert "PLACEHOLDER" in (ROOT / "Pulumi.prod.yaml").read_text()


def test_bad_addon_images_are_reported_in_one_round(tmp_path: Path, capsys: pytest.CaptureFixture):
    doc = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())
    bad = copy.deepcopy(doc)
    bad["config"]["supernode:images"]["addons"] = {
        "dcgm": "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.9-3.6.1-ubuntu22.04",  # not an add-on name
        "nvidia-device-plugin": "nvcr.io/nvidia/k8s-device-plugin:latest",  # a moving tag
        "training-operator": "kubeflow/training-operator",  # neither tag nor digest
    }
    f = tmp_path / "Pulumi.bad.yaml"
    f.write_text(yaml.safe_dump(bad))
    assert main(["plan", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "3 problem(s)" in err and "Traceback" not in err
    assert "supernode:images.addons.dcgm" in err and "'dcgm-exporter'" in err
    assert "supernode:images.addons.nvidia-device-plugin" in err and ":latest" in err
    assert "supernode:images.addons.training-operator" in err and "REPOSITORY:TAG@sha256:" in err
