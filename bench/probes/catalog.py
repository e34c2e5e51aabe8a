"""Registration at scale: from ``serve`` to serving N adapters (issue 29; lifecycle step 0).

For each count N: N adapters of one model shape (made once under ``--cache``: one written by
``make-adapters``, the others copies of it with their last 8 bytes changed, so every version differs), a
service of ``--replicas`` x ``--tp`` CPU worker actors on an embedded Ray, then the whole directory
registered the way ``serve --adapters DIR`` registers it. Per N it reports:

- ``start_s``: Ray, the controller and the workers up (nothing registered); ``register_s``: the
  registration, until the controller and every worker know all N; ``serving_s``: the two together;
- ``read_mb``: bytes each process read while registering (``rchar`` of ``/proc/PID/io``: every ``read`` and
  ``pread``, sockets included, so Ray's own messages too), for the controller and each worker, and per
  adapter against the adapters' bytes on disk;
- the controller's ``status`` call (a Ray call from a thread of this driver) while idle before and during
  the registration: p50 and p99 in ms, and how many calls;
- ``rss``: each process's resident memory growth over the registration, per adapter (bytes); with ``--heap``,
  the Python heap each process still holds per adapter after it (tracemalloc, started just before).

A run makes its own Ray cluster (2 CPUs by default) and shuts it down. Both the code before issue 29 (one
``register_adapter`` call per adapter) and after (``serve.register_directory``: batches) are measured by
the same script, as it finds them. The 8B shape's 100 adapters take 8.4 GB of disk under ``--cache``.

    python -m bench.probes.catalog --counts 100,1000,10000 --out results/catalog/tiny.json
    python -m bench.probes.catalog --counts 100 --model llama-3.1-8b --max-rank 16 --rank 16
    python -m bench.probes.catalog --counts 100 --model llama-3.1-8b --max-rank 16 --rank 16 --local-versions content
    python -m bench.probes.catalog --counts 1000 --heap --distinct-tables   # no module table shared

``--distinct-tables``: every adapter has its own module table (its own ``lora_alpha``), the catalogue that
interning cannot share; ``worker_specs_parsed`` says how many specs each worker holds parsed after the
registration (all of them before lazy specs; none after, until an adapter is loaded or staged).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def make_adapters(root: Path, model: str, rank: int, count: int) -> int:
    """``count`` adapter directories under ``root`` (kept from an earlier run if complete); their bytes."""
    from lora_cache.adapters.shapes import resolve_model
    from lora_cache.adapters.synth import SynthConfig, write_adapter

    names = [f"adapter-{i:05d}" for i in range(count)]
    first = root / names[0]
    if not (first / WEIGHTS).is_file():
        import torch

        synth = SynthConfig(model=model, count=1, rank=str(rank))
        write_adapter(first, resolve_model(model), rank, synth.alpha, synth.target_list(), torch.bfloat16,
                      torch.Generator().manual_seed(0))
    weights = (first / WEIGHTS).read_bytes()
    for i, name in enumerate(names[1:], start=1):
        out = root / name
        if (out / WEIGHTS).is_file():
            continue
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(first / CONFIG, out / CONFIG)
        (out / WEIGHTS).write_bytes(weights[:-8] + i.to_bytes(8, "little"))  # a tensor's last bytes: its own version
    return count * (len(weights) + (first / CONFIG).stat().st_size)


def make_distinct(root: Path, model: str, rank: int, count: int) -> int:
    """``count`` adapters under ``root``, each with its own module table: one weights file (hard links of the
    first adapter of ``make_adapters``) and a config per adapter whose ``lora_alpha`` differs, so every module's
    scaling, the config and the version differ (the catalogue where no two adapters share a table); their bytes."""
    source = root.parent / f"{root.name}-source"
    make_adapters(source, model, rank, 1)
    first = source / "adapter-00000"
    config = json.loads((first / CONFIG).read_text())
    for i in range(count):
        out = root / f"adapter-{i:05d}"
        if (out / WEIGHTS).is_file() and (out / CONFIG).is_file():
            continue
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG).write_text(json.dumps({**config, "lora_alpha": float(config["lora_alpha"]) + i / 1024}))
        os.link(first / WEIGHTS, out / WEIGHTS)  # one file on disk: each adapter's own version from its config
    return (first / WEIGHTS).stat().st_size + count * (first / CONFIG).stat().st_size


def proc_figures(pid: int) -> tuple[int, int]:
    """(bytes read by read/pread so far, resident bytes) of a process on this machine."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(io["rchar"]), int(status["VmRSS"].split()[0]) * 1024


class StatusProbe:
    """The controller's ``status`` round trip, called back to back from a thread until stopped."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            t0 = time.perf_counter()
            ray.get(self.controller.status.remote())
            self.times.append(time.perf_counter() - t0)
            self._stop.wait(0.002)

    def __enter__(self) -> StatusProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _code() -> str:
    """Where the process took lora_cache from (the checkout measured)."""
    import lora_cache

    return str(Path(lora_cache.__file__).parent.parent)


def _heap_start() -> None:
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()


def _heap_stop() -> int:
    """Bytes of Python heap allocated since ``_heap_start`` and still alive (after a collection)."""
    import gc
    import tracemalloc

    gc.collect()
    grown = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return grown


def _parsed_count(actor: Any) -> int:
    """Specs a worker holds parsed (every registered one before lazy specs)."""
    catalog = actor.catalog
    return len(catalog.parsed()) if hasattr(catalog, "parsed") else len(catalog)


def quantiles_ms(times: list[float]) -> dict[str, float]:
    if not times:
        return {"calls": 0}
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"calls": len(ordered), "p50_ms": round(statistics.median(ordered) * 1e3, 2),
            "p99_ms": round(p99 * 1e3, 2), "max_ms": round(ordered[-1] * 1e3, 2)}


def registrar(controller: Any) -> tuple[str, Callable[[Path], None]]:
    """How ``serve --adapters DIR`` registers a directory in the code this runs on: (its name, a call)."""
    import ray

    from lora_cache.app import serve

    batched = getattr(serve, "register_directory", None)
    if batched is not None:
        return "register_adapters batches (serve.register_directory)", lambda root: batched(controller, root)

    def one_by_one(root: Path) -> None:  # serve.start's loop before issue 29
        for d in sorted(root.iterdir()):
            if (d / CONFIG).is_file():
                ray.get(controller.register_adapter.remote(d.name, str(d)))

    return "one register_adapter call per adapter", one_by_one


def measure(root: Path, count: int, ns: argparse.Namespace) -> dict[str, Any]:
    import ray

    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.app.serve import ServeConfig, start
    from lora_cache.planner import PlannerConfig
    from workers.cache import WorkerConfig
    from workers.staging.host_config import HostTierConfig

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=ns.cpus, namespace="lora-cache", include_dashboard=False)
    try:
        service = start(ServeConfig(replicas=ns.replicas, tp=ns.tp),
                        CatalogConfig(adapter_roots=(str(root),), model=ns.model, max_rank=ns.max_rank,
                                      **({"local_versions": ns.local_versions} if ns.local_versions else {})),
                        PlannerConfig(), WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 30, pin=False)))
        started = time.perf_counter() - t0
        how, register = registrar(service.controller)
        pids = {"controller": ray.get(service.controller.__ray_call__.remote(lambda self: os.getpid()))}
        code = ray.get(service.controller.__ray_call__.remote(lambda self: _code()))
        for wid, handle in sorted(service.workers.items()):
            pids[str(wid)] = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
        with StatusProbe(service.controller) as idle:
            time.sleep(1.0)  # the idle reference: status calls with nothing else going on
        handles = {"controller": service.controller, **{str(w): h for w, h in service.workers.items()}}
        if ns.heap:  # Python's heap from here on, in every process (slows the registration: not timed then)
            ray.get([h.__ray_call__.remote(lambda self: _heap_start()) for h in handles.values()])
        before = {k: proc_figures(p) for k, p in pids.items()}
        t1 = time.perf_counter()
        with StatusProbe(service.controller) as busy:
            register(root)
        registered = time.perf_counter() - t1
        after = {k: proc_figures(p) for k, p in pids.items()}
        heap = {k: ray.get(h.__ray_call__.remote(lambda self: _heap_stop())) // count for k, h in handles.items()} \
            if ns.heap else {}
        status = ray.get(service.controller.status.remote())
        known = [len(ray.get(h.describe.remote())["adapters"]) for h in service.workers.values()]
        parsed = [ray.get(h.__ray_call__.remote(_parsed_count)) for h in service.workers.values()]
        assert status["adapters"] == count and all(k == count for k in known), (status["adapters"], known)
        service.stop()
    finally:
        ray.shutdown()
    return {"count": count, "how": how, "code": code, "start_s": round(started, 2), "register_s": round(registered, 2),
            "serving_s": round(started + registered, 2),
            "read_mb": {k: round((after[k][0] - before[k][0]) / 1e6, 1) for k in pids},
            "rss_per_adapter": {k: (after[k][1] - before[k][1]) // count for k in pids},
            **({"heap_per_adapter": heap} if heap else {}), "worker_specs_parsed": parsed,
            "status_idle": quantiles_ms(idle.times), "status_registering": quantiles_ms(busy.times)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.catalog", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="100,1000,10000", help="comma-separated adapter counts")
    parser.add_argument("--model", default="tiny", help="model shape of the adapters")
    parser.add_argument("--rank", type=int, default=8, help="their LoRA rank")
    parser.add_argument("--max-rank", type=int, default=16, help="the catalog's largest rank")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of CPU workers")
    parser.add_argument("--tp", type=int, default=2, help="workers per replica")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the embedded Ray")
    parser.add_argument("--local-versions", default="", help="the catalog's local_versions ('identity' or "
                        "'content'; empty: its default, or what the code measured has)")
    parser.add_argument("--heap", action="store_true", help="also the Python heap each process holds per adapter "
                        "after the registration (tracemalloc: the registration is slower, its timings not comparable)")
    parser.add_argument("--distinct-tables", action="store_true", help="every adapter with its own module table "
                        "(its own lora_alpha; the weights one file, hard-linked): no table shared between entries")
    parser.add_argument("--cache", default="/tmp/lora-cache-bench-catalog", help="where the adapters are made")
    parser.add_argument("--out", help="also write the results here (JSON)")
    ns = parser.parse_args(argv)
    counts = [int(c) for c in ns.counts.split(",") if c.strip()]
    if not counts or min(counts) < 1:
        parser.error(f"--counts {ns.counts!r}: give positive counts such as 100,1000,10000")
    results = []
    for count in counts:
        root = Path(ns.cache) / f"{ns.model}-r{ns.rank}{'-distinct' if ns.distinct_tables else ''}" / str(count)
        disk = (make_distinct if ns.distinct_tables else make_adapters)(root, ns.model, ns.rank, count)
        row = {**measure(root, count, ns), "model": ns.model, "disk_mb": round(disk / 1e6, 1),
               "distinct_tables": ns.distinct_tables,
               "local_versions": ns.local_versions or "default"}
        record(row, results)
    write_results(ns.out, results)
    return 0


def record(row: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """One result row printed as it comes (a JSON line) and kept."""
    print(json.dumps(row), flush=True)
    results.append(row)


def write_results(out: str | None, results: list[dict[str, Any]]) -> None:
    """The rows as one JSON file at ``out`` (its folder made), if given."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
