"""The tree is the architecture: who may import whom (docs/architecture.md, "Floors").

``lora_cache/`` is grouped by role into floors; a module imports only its own sub-package and the floors
below it. The data plane (``workers/``) speaks the shared vocabulary (``lora_cache.vocab``) and reads adapter
files, but never imports the planner, the controller, the routing advice or the application. Nothing in
``lora_cache/`` imports ``workers/`` or ``bench/`` except at two named seams: the application, which starts
workers, and ``lora_cache.attach``, the engine's entry point. ``workers/`` is in floors of its own, by lifecycle
step (``WORKERS_FLOORS``): no arrow up, and no cycle between its sub-packages. Every arrow is read from the code
(``ast``), type-only imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# lora_cache's floors, lowest first: each may import its own floor's packages and anything below.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("lora_cache.errors", "lora_cache.vocab"),  # words both floors share
    ("lora_cache.adapters", "lora_cache.link"),  # adapter files and catalog; the relay to an attached rank
    ("lora_cache.runtime",),  # process plumbing: metrics, GC, joining a cluster, CLI from configs
    ("lora_cache.planner",),  # the pure fleet planner
    ("lora_cache.routing",),  # routing advice over the planner's view
    ("lora_cache.controller",),  # the controller's core and actor
    ("lora_cache.api",),  # the gRPC contract, servicer, gateway and client
    ("lora_cache.app", "lora_cache.integrations"),  # the CLI and `serve` (starts workers, a named seam); serving
    # frameworks' integrations (Ray Serve), over the client and the engine seam: nothing below imports them
)
# Imports of workers/ or bench/ from lora_cache/, each at a named seam: (importing module prefix, imported prefix)
SEAMS = (
    ("lora_cache.app", "workers"),  # the application that starts workers (serve, demo, the CLI's configs)
    ("lora_cache", "workers.attach.attachment"),  # `lora_cache.attach`, the engine's entry point (lora_cache/__init__)
    ("lora_cache.integrations", "workers.attach.attachment"),  # serving frameworks' replicas attach through the seam
)
# What the data plane may use of lora_cache/: no planner, routing, controller or application.
WORKERS_MAY_USE = ("lora_cache.errors", "lora_cache.vocab", "lora_cache.adapters", "lora_cache.link",
                   "lora_cache.runtime", "lora_cache.api.v1", "lora_cache.api.relay_codec", "lora_cache")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(package: str) -> list[tuple[str, str]]:
    """(importing module, imported module) for every absolute import in ``package``."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        here = _module(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                base = ROOT / node.module.replace(".", "/")
                subs = [f"{node.module}.{a.name}" for a in node.names
                        if (base / a.name).is_dir() or (base / f"{a.name}.py").exists()]
                out += [(here, s) for s in subs] if len(subs) == len(node.names) else [(here, node.module)]
            elif isinstance(node, ast.Import):
                out += [(here, a.name) for a in node.names]
    return out


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _floor(module: str) -> int | None:
    for i, packages in enumerate(FLOORS):
        if any(_under(module, p) for p in packages):
            return i
    return None


def test_every_lora_cache_module_has_a_floor() -> None:
    loose = [m for m, _ in _imports("lora_cache") if m != "lora_cache" and _floor(m) is None]
    assert not loose, f"modules outside every floor of tests/test_layers.py FLOORS: {sorted(set(loose))}"


def test_lora_cache_imports_only_downward() -> None:
    upward = []
    for here, there in _imports("lora_cache"):
        mine, theirs = _floor(here), _floor(there)
        if here == "lora_cache" or mine is None or theirs is None:
            continue
        if theirs > mine:
            upward.append(f"{here} -> {there}")
    assert not upward, "imports that run up a floor (move the shared part down, or the importer up):\n" + \
        "\n".join(sorted(set(upward)))


@pytest.mark.parametrize("other", ["workers", "bench"])
def test_lora_cache_imports_workers_and_bench_only_at_seams(other: str) -> None:
    crossing = sorted({f"{here} -> {there}" for here, there in _imports("lora_cache") if _under(there, other)
                       and not any(_under(here, h) and _under(there, t) and (h != "lora_cache" or here == h)
                                   for h, t in SEAMS)})
    assert not crossing, f"lora_cache/ imports {other}/ outside the named seams {SEAMS}:\n" + "\n".join(crossing)


def test_workers_use_the_vocabulary_not_the_control_plane() -> None:
    bad = sorted({f"{here} -> {there}" for here, there in _imports("workers") if _under(there, "lora_cache")
                  and not any(_under(there, p) if p != "lora_cache" else there == p for p in WORKERS_MAY_USE)})
    assert not bad, "workers/ imports the control plane (take the words from lora_cache.vocab):\n" + "\n".join(bad)


# workers/' floors, lowest first (docs/architecture.md, "Floors"): each may import its own floor's packages and
# anything below; no cycle between its sub-packages, even within one floor.
WORKERS_FLOORS: tuple[tuple[str, ...], ...] = (
    ("workers.faults", "workers.counters", "workers.lru", "workers.kernels"),  # fault points, counters, the LRU,
    # the Triton kernels: what every stage may use
    ("workers.reads",),  # step 5: a rank's slices of a file read, the version proven on the way
    ("workers.staging",),  # step 5: the pinned host tier over reads, the node's disk tier, the arena
    ("workers.gpu",),  # steps 6-7, 9: slots, streams, chunk copies, the load path, acquire
    ("workers.cache",),  # steps 5-9: `WorkerCache` composes the floors below
    ("workers.control",),  # steps 4, 7: commands, the outbox, what the controller calls on a rank
    ("workers.attach",),  # steps 4, 9: the engine seam, its transports, the version exchange
    ("workers.engine",),  # the reference engine, over the seam
    # the worker actor: hosts a rank's control, an engine rank and a trainer's pushes
    ("workers.actor", "workers.actor_engine", "workers.actor_images"),
)


def _workers_floor(module: str) -> int | None:
    return next((i for i, packages in enumerate(WORKERS_FLOORS) if any(_under(module, p) for p in packages)), None)


def _workers_unit(module: str) -> str | None:
    """The floor package ``module`` belongs to (``workers.reads``, ``workers.cache``, ...), or None."""
    return next((p for packages in WORKERS_FLOORS for p in packages if _under(module, p)), None)


def _workers_arrows() -> list[tuple[str, str]]:
    return [(here, there) for here, there in _imports("workers") if here != "workers" and _under(there, "workers")]


def test_every_workers_module_has_a_floor() -> None:
    modules = {_module(p) for p in (ROOT / "workers").rglob("*.py")} - {"workers"}
    loose = sorted(m for m in modules if _workers_floor(m) is None)
    assert not loose, f"workers/ modules outside every floor of tests/test_layers.py WORKERS_FLOORS: {loose}"


def test_workers_import_only_downward() -> None:
    upward = sorted({f"{here} -> {there}" for here, there in _workers_arrows()
                     if (mine := _workers_floor(here)) is not None and (theirs := _workers_floor(there)) is not None
                     and theirs > mine})
    assert not upward, "workers/ imports that run up a floor (move the shared part down):\n" + "\n".join(upward)


def test_workers_sub_packages_have_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for here, there in _workers_arrows():
        a, b = _workers_unit(here), _workers_unit(there)
        if a is not None and b is not None and a != b:
            graph.setdefault(a, set()).add(b)
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the path, 2 done

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt, 0) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif state.get(nxt, 0) == 0:
                visit(nxt, [*path, nxt])
        state[unit] = 2

    for unit in sorted(graph):
        if state[unit] == 0:
            visit(unit, [unit])
    assert not cycles, "import cycles between workers/ sub-packages:\n" + "\n".join(cycles)


# One-way seams inside a workers/ sub-package: (lower module, the module it must never import). The load path
# composes the chunk copies; they never reach back.
WORKERS_ONE_WAY = (("workers.gpu.copies", "workers.gpu.loads"), ("workers.gpu.copies", "workers.gpu.acquire"))


def test_workers_seams_run_one_way() -> None:
    back = sorted({f"{here} -> {there}" for here, there in _imports("workers") for low, high in WORKERS_ONE_WAY
                   if _under(here, low) and _under(there, high)})
    assert not back, "imports back across a one-way seam of workers/ (move the shared part down):\n" + "\n".join(back)
