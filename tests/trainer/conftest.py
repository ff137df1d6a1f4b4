"""Fixtures for the trainer tests (spawning ranks: tests/trainer/ranks.py)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo process group, for code that needs torch.distributed without spawning."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    yield
    dist.destroy_process_group()


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 256 KiB tmpfs, mounted and removed by the test (root only): a real ENOSPC, not an injected one."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the injected-fault tests cover the rest")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
