"""Every module imports, and every package the code and the tests import is declared in pyproject.toml.

CI once passed only because the machine had triton installed by hand. ``.ci/run`` now installs into a
fresh virtualenv, where an undeclared package fails to import; these tests name the culprit directly,
and catch one that only a module nobody's tests import would have needed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import pkgutil
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lora_cache", "workers", "bench")
FIRST_PARTY = {*PACKAGES, "tests", "conftest", "examples"}


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package)
        path = [str(ROOT / package)]
        for info in pkgutil.walk_packages(path, prefix=f"{package}."):
            if not info.name.endswith("__main__"):  # runs its program on import
                names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("module", _modules())
def test_every_module_imports(module: str) -> None:
    importlib.import_module(module)


def _declared() -> set[str]:
    """Distribution names in pyproject's dependencies and its ``test`` extra, normalized."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        requirements = importlib.metadata.requires("lora-cache") or []
    else:
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        requirements = [*project["dependencies"], *_extra(project, "test")]
    return {_normalize(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in requirements}


def _extra(project: dict[str, Any], name: str) -> list[str]:
    """An extra's requirements, with the extras of lora-cache itself it names (``lora-cache[server,gpu]``) expanded."""
    out: list[str] = []
    for r in project["optional-dependencies"][name]:
        own = re.fullmatch(r"lora-cache\[([a-z,\s-]+)\]", r)
        out += [x for e in own.group(1).split(",") for x in _extra(project, e.strip())] if own else [r]
    return out


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports() -> dict[str, set[str]]:
    """``{top-level module: files importing it}`` over the package and the tests, stdlib excluded."""
    found: dict[str, set[str]] = {}
    for directory in (*PACKAGES, "tests"):
        for path in (ROOT / directory).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if top not in sys.stdlib_module_names and top not in FIRST_PARTY and top != "__future__":
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared() -> None:
    declared, providers = _declared(), importlib.metadata.packages_distributions()
    undeclared = {}
    for top, files in sorted(_third_party_imports().items()):
        dists = {_normalize(d) for d in providers.get(top, [])}
        if not dists & declared:
            undeclared[top] = (sorted(dists) or ["not installed"], sorted(files)[:3])
    assert not undeclared, ("imported but not declared in pyproject.toml (dependencies or the test extra): "
                            f"{undeclared}")
