"""The docs name every module: docs/architecture.md's module map, and each sub-package's README.md.

The module map is a table of rows ``| `folder/` | steps | modules |``; a row names a module of its folder as
`` `name.py` `` and a sub-package as `` `name/` `` (paths with a slash elsewhere in a row are references, not
entries). A package's ``__init__.py`` is the package itself: named by a row of its folder, or by its parent's
row naming `` `name/` ``. Generated protobuf modules (``*_pb2*.py``) count as their folder (``api/v1/``).
Every directory of ``lora_cache/``, ``workers/`` and ``bench/`` that holds modules, but ``lora_cache/`` itself
(the module map is its page) and generated ``api/v1/``, has a README.md whose "## Files" section names
each of its modules (``__init__.py`` too) and sub-packages, and nothing that is not there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lora_cache", "workers", "bench")
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = 130
NO_README = ("lora_cache", "lora_cache/api/v1")  # the module map's own package; generated code
ROW = re.compile(r"^\|\s*`([\w/]+/)`\s*\|(.*)$")
NAME = re.compile(r"`([\w.]+\.py|\w+/)`")  # `name.py` or `name/`: no slash inside, so no path of another folder


def _modules() -> list[Path]:
    """Every module of the three packages, relative to the repository (what is on disk: new files too)."""
    return sorted(p.relative_to(ROOT) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


def _generated(path: Path) -> bool:
    return "_pb2" in path.name


def _section(text: str, heading: str) -> str:
    """The lines under ``## heading`` up to the next ``## ``."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def _map_entries() -> list[tuple[str, str]]:
    """(folder, name) for every module (`name.py`) or sub-package (`name/`) the module map names."""
    entries = []
    for line in _section(ARCHITECTURE.read_text(), "Module map").splitlines():
        row = ROW.match(line)
        if row:
            entries.append((row.group(1), ""))  # the row's folder itself
            entries += [(row.group(1), name) for name in NAME.findall(row.group(2))]
    return entries


def _named_in_map(module: Path, named: set[tuple[str, str]]) -> bool:
    folder = f"{module.parent.as_posix()}/"
    if _generated(module) or module.name == "__init__.py":  # the package itself
        parent = f"{module.parent.parent.as_posix()}/"
        return (folder, "") in named or (parent, f"{module.parent.name}/") in named
    return (folder, module.name) in named


def test_architecture_is_short() -> None:
    lines = len(ARCHITECTURE.read_text().splitlines())
    assert lines <= MAX_LINES, f"docs/architecture.md has {lines} lines (at most {MAX_LINES}): move detail to " \
        "docs/decisions.md or a sub-package's README.md"


def test_module_map_names_every_module_once() -> None:
    entries = _map_entries()
    named = set(entries)
    missing = [m.as_posix() for m in _modules() if not _named_in_map(m, named)]
    twice = sorted({f"{folder}{name}" for folder, name in entries if name and entries.count((folder, name)) > 1})
    stale = sorted({f"{folder}{name}" for folder, name in named if not (ROOT / folder / name).exists()})
    problems = [f"{what}: {', '.join(names)}" for what, names in (
        ("not in the module map", missing), ("named more than once", twice),
        ("named but not on disk (renamed or removed?)", stale)) if names]
    assert not problems, "docs/architecture.md, '## Module map':\n" + "\n".join(problems)


@pytest.mark.parametrize(("name", "package"), [("FLOORS", "lora_cache"), ("WORKERS_FLOORS", "workers")])
def test_floors_match_the_layer_test(name: str, package: str) -> None:
    tree = ast.parse((ROOT / "tests" / "test_layers.py").read_text())
    floors = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.AnnAssign)
                  and isinstance(node.target, ast.Name) and node.target.id == name)
    rows = [re.findall(rf"`({package}\.\w+)`", line) for line in
            _section(ARCHITECTURE.read_text(), "Floors").splitlines() if line.startswith("|")]
    documented = [tuple(row) for row in rows if row]
    assert [set(f) for f in documented] == [set(f) for f in floors], \
        f"docs/architecture.md '## Floors' lists {documented}; tests/test_layers.py {name} is {list(floors)}"


def test_every_sub_package_has_a_readme_naming_its_files() -> None:
    folders: dict[Path, set[str]] = {}
    for module in _modules():
        if not _generated(module):
            folders.setdefault(module.parent, set()).add(module.name)
        if module.parent.parent.as_posix() not in (".", *NO_README):  # a sub-package, named by its parent
            folders.setdefault(module.parent.parent, set()).add(f"{module.parent.name}/")
    problems = []
    for folder, names in sorted(folders.items()):
        if folder.as_posix() in NO_README:
            continue
        readme = ROOT / folder / "README.md"
        if not readme.exists():
            problems.append(f"{folder}/README.md is missing (it lists {', '.join(sorted(names))})")
            continue
        listed = set(NAME.findall(_section(readme.read_text(), "Files")))
        if names - listed:
            problems.append(f"{folder}/README.md does not name: {', '.join(sorted(names - listed))}")
        if listed - names:
            problems.append(f"{folder}/README.md names what is not there: {', '.join(sorted(listed - names))}")
    assert not problems, "sub-package READMEs ('## Files' sections):\n" + "\n".join(problems)
