"""The image-placeholder finding names the key that sets the image it found (issue 31): the trainer's
comes from images.trainer (`make image` builds it), the serving pods' from inference.image (a vLLM
release image that `make image` does not build)."""

from __future__ import annotations

from pathlib import Path

from supernode.core import resource_types as T
from supernode.core.config import load_stack
from supernode.core.config.schema import PLACEHOLDER_DIGEST
from supernode.tools.policycheck import check, config_from_stack
from supernode.tools.preview import run_program

ROOT = Path(__file__).resolve().parents[2]
LABEL = "app.kubernetes.io/component"


def test_each_placeholder_names_the_key_that_sets_its_image():
    cfg = load_stack("prod", ROOT)  # the repository's prod: both images still the placeholder digest
    assert cfg.images.trainer.endswith(PLACEHOLDER_DIGEST) and cfg.inference.image.endswith(PLACEHOLDER_DIGEST)
    resources = [r.to_json() for r in run_program("prod", cfg).resources]
    kind = {r["urn"]: r["type"] for r in resources}
    component = {r["urn"]: ((r["inputs"].get("metadata") or {}).get("labels") or {}).get(LABEL) for r in resources}
    found = [v for v in check(resources, config_from_stack(cfg)).violations if v.policy == "image-placeholder"]
    serving = [v.message for v in found if component.get(v.urn) == "serving"]
    trainer = [v.message for v in found if kind.get(v.urn) == T.PYTORCH_JOB]
    assert serving and trainer, [v.message for v in found]
    for message in serving:
        assert "supernode:inference.image" in message and "images.trainer" not in message, message
    for message in trainer:
        assert "`make image STACK=<stack>`" in message and "supernode:images.trainer" in message, message
