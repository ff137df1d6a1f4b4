"""Fixtures for the AWS components: the dev and prod previews (see aws_preview.py)."""

from __future__ import annotations

import pytest
from aws_preview import Stack, preview


@pytest.fixture(params=["dev", "prod"])
def stack(request) -> Stack:
    return preview(request.param)
