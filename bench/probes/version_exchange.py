"""Host cost of the engine's version exchange per round (workers/attach/versions.py), without the all-reduce.

One rank's report (``RankVersions.rows``) and rank 0's reading of it (``ReducedVersions``: readiness, step
failures, one adapter's versions), for N registered adapters with 8 READY: what every round of every
admission rule pays since issue 19. ``python -m bench.probes.version_exchange [--adapters 100 1000]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.vocab import AdapterKey
from workers.attach.versions import COLUMNS, RankVersions, ReducedVersions


def measure(catalog: AdapterCatalog, n: int, rounds: int) -> float:
    """Microseconds per round for the first ``n`` adapters of ``catalog``."""
    names = catalog.names()[:n]
    versions = RankVersions(catalog, names)
    ready = [AdapterKey(name, catalog.get(name).version) for name in names[:8]]
    versions.rows(ready)  # the first report computes the current versions' codes
    t0 = time.perf_counter()
    for _ in range(rounds):
        view = ReducedVersions(versions.rows(ready), names, versions.codes)
        view.readiness()
        view.step_failures()
        view.versions()[names[0]]
    return (time.perf_counter() - t0) / rounds * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lora-exchange-") as tmp:
        make_adapters(Path(tmp), SynthConfig(model="tiny", count=max(args.adapters), rank="8"))
        catalog = AdapterCatalog(CatalogConfig(adapter_roots=(tmp,), model="tiny", max_rank=16))
        catalog.register_dir(tmp)
        for n in args.adapters:
            print(f"adapters={n}: report + view {measure(catalog, n, args.rounds):.1f} us per round, "
                  f"all-reduce message {n * COLUMNS * 8} bytes", flush=True)


if __name__ == "__main__":
    main()
