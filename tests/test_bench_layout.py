"""bench/'s floor plan: imports run one way (docs/architecture.md, bench/README.md).

The job (``bench.run``) stands on its configuration (``bench.config``), the router's rules, the real path and
the simulator (``bench.sim``); the simulator, its ``job`` path and its ``check`` against a real run never
import the job, so ``python -m bench.sim.check`` loads no more than it needs. Probes (``bench.probes``) stand
beside the job: nothing in bench/ imports them. Every arrow is read from the code (``ast``), imports inside
functions included; importing a module also imports its parent packages' ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = ROOT / name.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _targets(importer: str, module: str) -> set[str]:
    """``module`` and the parent packages that importing it runs, but the importer's own."""
    parts = module.split(".")
    out = {module}
    for i in range(2, len(parts)):
        parent = ".".join(parts[:i])
        if not (importer == parent or importer.startswith(parent + ".")):
            out.add(parent)
    return out


def _graph() -> dict[str, set[str]]:
    """bench module -> the bench modules it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted(BENCH.rglob("*.py")):
        here = _name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")]
                found |= set(modules) if len(modules) == len(node.names) else {node.module}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[here] = {t for m in found if m.split(".")[0] == "bench" for t in _targets(here, m)} - {here}
    return graph


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_bench_has_no_import_cycle() -> None:
    graph = _graph()
    cycles = sorted(m for m in graph if m in _reach(graph, m))
    assert not cycles, f"modules of bench/ that import themselves through others: {cycles}"


def test_the_simulator_never_imports_the_job() -> None:
    graph = _graph()
    below = [m for m in graph if m == "bench.config" or m.startswith(("bench.sim", "bench.router"))]
    upward = sorted(f"{m} -> bench.run" for m in below if "bench.run" in _reach(graph, m))
    assert not upward, "the simulator and the job's configuration must not import the job:\n" + "\n".join(upward)


def test_nothing_in_bench_imports_a_probe() -> None:
    graph = _graph()
    users = sorted(f"{m} -> {t}" for m, ts in graph.items() if not m.startswith("bench.probes")
                   for t in ts if t.startswith("bench.probes"))
    assert not users, "probes stand beside the benchmark; nothing imports them:\n" + "\n".join(users)
    assert {m for m in graph if m.startswith("bench.probes.")}, "no probes found: has bench/probes/ moved?"
