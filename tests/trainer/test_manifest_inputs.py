"""Issue 31: the manifest lists its corpus files by their path under the files' common directory, so
a tree of sources (many `__init__.py`) is recorded without collisions."""

from __future__ import annotations

import json

from supernode.trainer.data.manifest import MANIFEST
from supernode.trainer.data.prepare import prepare


def test_inputs_are_recorded_relative_to_their_common_directory(tmp_path):
    tree = tmp_path / "src"
    files = []
    for package in ("a", "a/b", "c"):
        f = tree / package / "__init__.py"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"# package {package}\n" * (1 + len(package)), encoding="utf-8")
        files.append(f)
    prepare(files, tmp_path / "out", shard_tokens=64, workers=1)
    inputs = json.loads((tmp_path / "out" / MANIFEST).read_text())["inputs"]
    assert [i["file"] for i in inputs] == ["a/__init__.py", "a/b/__init__.py", "c/__init__.py"]
    assert [i["bytes"] for i in inputs] == [f.stat().st_size for f in files]


def test_one_file_is_recorded_by_its_name(tmp_path):
    f = tmp_path / "deep" / "corpus.txt"
    f.parent.mkdir()
    f.write_text("one document\n", encoding="utf-8")
    prepare([f], tmp_path / "out", shard_tokens=64, workers=1)
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["inputs"] == [{"file": "corpus.txt", "bytes": 13}]
