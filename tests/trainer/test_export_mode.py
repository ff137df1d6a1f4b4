"""Issue 31: the exported weights get the mode of the export's other files (safetensors writes a
private 0600 temporary file and renames it into place)."""

from __future__ import annotations

import os
import stat

import pytest
from test_export import GLM, _checkpoint, _export

pytest.importorskip("transformers")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_exported_file_has_the_umask_mode(tmp_path, umask):
    _, path = _checkpoint(tmp_path, GLM)
    old = os.umask(umask)
    try:
        out = _export(tmp_path, path, dtype="fp32", shard_bytes=200_000)  # several shards
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert sum(name.endswith(".safetensors") for name in modes) > 1
    assert modes["config.json"] == 0o666 & ~umask
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), {n: oct(m) for n, m in modes.items()}
