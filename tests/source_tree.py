"""The package's sources as pyproject.toml maps them: supernode/ and the design card's top-level components/,
trainer/ and policies/, installed as supernode.components, supernode.trainer and supernode.policies
(supernode/ links to them in the checkout). Each file once, by its real path; `stage` copies the package
laid out as installed (a tree a test may break)."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
# import name -> its directory in the checkout, outermost first
PACKAGE_DIRS: dict[str, Path] = {name: ROOT / d for name, d in SETUPTOOLS["package-dir"].items()}


def installed_files() -> dict[Path, Path]:
    """Every file of the package: its path in an installed tree (supernode/...) -> its path in the checkout."""
    files: dict[Path, Path] = {}
    for name, directory in PACKAGE_DIRS.items():
        nested = {d for d in PACKAGE_DIRS.values() if d != directory and d.is_relative_to(directory)}
        for path in directory.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and not any(path.is_relative_to(d) for d in nested):
                files[Path(*name.split("."), path.relative_to(directory))] = path
    return files


def source_files() -> list[Path]:
    """The package's Python sources in the checkout."""
    return sorted(p for p in installed_files().values() if p.suffix == ".py")


def stage(dest: Path) -> Path:
    """The package laid out as installed (dest/supernode/components/...), for tools that walk directories."""
    for installed, source in installed_files().items():
        (dest / installed).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / installed)
    return dest
