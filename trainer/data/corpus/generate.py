"""Regenerate the shipped demo corpus from the Python standard library's own documentation.

The corpus is real English technical prose: the docstrings of well-known standard-library modules,
their classes and functions, exactly as CPython ships them (PSF licence). It was generated once
with this script and committed, so nothing downloads or generates at run time:

    python -m supernode.trainer.data.corpus.generate      # rewrites trainer/data/corpus/stdlib_docs.txt
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

MODULES = (
    "abc argparse asyncio base64 bisect calendar collections contextlib csv dataclasses datetime "
    "decimal difflib email enum fractions functools glob gzip hashlib heapq html http inspect io "
    "itertools json logging math operator os pathlib pickle pprint queue random re shutil socket "
    "sqlite3 statistics string struct subprocess tarfile tempfile textwrap threading time timeit "
    "typing unittest urllib uuid warnings weakref zipfile"
).split()
MAX_BYTES = 400_000
OUT = Path(__file__).with_name("stdlib_docs.txt")


def _docs(name: str) -> list[str]:
    mod = importlib.import_module(name)
    parts = [f"Module {name}\n\n{inspect.cleandoc(mod.__doc__ or '')}"]
    for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
        obj = getattr(mod, attr, None)
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", "").split(".")[0] != name.split(".")[0]:
            continue  # re-exported from elsewhere
        doc = inspect.getdoc(obj)
        if doc and len(doc) > 80:
            parts.append(f"{name}.{attr}\n\n{doc}")
    return parts


def main() -> int:
    text, size = [], 0
    for name in MODULES:
        for part in _docs(name):
            data = part.strip() + "\n\n"
            if size + len(data.encode()) > MAX_BYTES:
                break
            text.append(data)
            size += len(data.encode())
    OUT.write_text("".join(text), encoding="utf-8")
    print(f"{OUT}: {size} bytes from {len(MODULES)} modules (Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
