"""The time to give back 1 GB of the adapter pool under load (issue 43 item 4; the pool that breathes, item 3).

    python -m bench.probes.give_back [--device cuda] [--model llama-3.1-8b] [--rank 16] [--adapters 30]
        [--pool-gb 2] [--give-gb 1] [--repeats 5] [--out FILE]

A real rank (``WorkerCache``, pages of ``--rank``, exclusive host tier) holds a full pool of real PEFT adapters
(``make_adapters``) while a load thread keeps acquiring and releasing batches of 4 adapters drawn Zipf 1.0 over the
catalog (misses load on demand, so loads and write-backs run throughout). Each repeat asks the pool for ``--give-gb``
(``PoolLender.give_back``, the batch's adapters kept), then takes it back. Reported per repeat: the call's host
time (bookkeeping and issuing the evicted adapters' write-backs: what an engine's step waits for), the time until
every event the lent pages wait for completed (their last batches and write-backs: when the engine may write them),
the pages lent and adapters evicted; and, in the same run, a reference: a plain copy of the lent bytes from the
device into host memory (what writing back a full gigabyte of evicted adapters costs at best). CPU or one GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from workers.cache import WorkerCache, WorkerConfig, pool_pages
from workers.staging.host_config import HostTierConfig

GB = 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait(cache: WorkerCache, events: tuple[Any, ...]) -> None:
    for event in events:
        cache.streams.host_wait(event)


def _load(cache: WorkerCache, names: list[str], stop: threading.Event, seed: int, counts: dict[str, int]) -> None:
    """Batches of 4 adapters, Zipf 1.0 over ``names``, acquired and released until ``stop``."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(names))]
    while not stop.is_set():
        picked = list(dict.fromkeys(rng.choices(names, weights, k=4)))
        try:
            batch = cache.acquire(picked, partial=True, slot_wait_s=1.0)
        except Exception:  # every page held or lent: the next batch tries again
            counts["refused"] += 1
            continue
        counts["batches"] += 1
        cache.release(batch)


def measure(ns: argparse.Namespace, root: Path) -> dict[str, Any]:
    device = torch.device(ns.device)
    paths = make_adapters(root, SynthConfig(model=ns.model, count=ns.adapters, rank=str(ns.rank)))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model=ns.model, max_rank=ns.max_rank))
    for path in paths:
        catalog.register(path.name, path)
    probe = WorkerConfig(num_slots=1, device=ns.device, page_rank=ns.rank, pool_pages=64,
                         host=HostTierConfig(host_bytes=int(4 * GB), pin=device.type == "cuda"))
    page_numel, _ = pool_pages(probe, catalog.shape, ns.max_rank, torch.bfloat16)
    page_bytes = page_numel * 2
    pages = int(ns.pool_gb * GB) // page_bytes
    config = WorkerConfig(num_slots=pages, device=ns.device, page_rank=ns.rank, pool_pages=pages,
                          host=HostTierConfig(host_bytes=int(ns.host_gb * GB), pin=device.type == "cuda",
                                              tiers="exclusive"))
    cache = WorkerCache(config, catalog)
    names = catalog.names()
    rng = random.Random(ns.seed)
    rng.shuffle(names)
    try:
        for name in names[:pages]:  # a full pool before the load starts
            cache.prefetch(name).result(timeout=120)
        cache.settle(120)
        counts = {"batches": 0, "refused": 0}
        stop = threading.Event()
        loader = threading.Thread(target=_load, args=(cache, names, stop, ns.seed, counts), daemon=True)
        loader.start()
        rows = []
        src = dst = torch.empty(0)
        time.sleep(ns.warm_s)  # the load thread has loads and write-backs in flight
        for _ in range(ns.repeats):
            t0 = time.perf_counter()
            lease = cache.lender.give_back(int(ns.give_gb * GB))
            t1 = time.perf_counter()
            _wait(cache, lease.after)
            t2 = time.perf_counter()
            if src.numel() != lease.nbytes // 2:  # the lent bytes, copied out (buffers touched once, not timed)
                src = torch.ones(lease.nbytes // 2, dtype=torch.bfloat16, device=device)
                dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=device.type == "cuda")
                dst.copy_(src)
            _sync(device)
            t3 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            t4 = time.perf_counter()
            rows.append({"call_ms": (t1 - t0) * 1e3, "ready_ms": (t2 - t0) * 1e3, "pages": len(lease.pages),
                         "lent_gb": lease.nbytes / GB, "evicted": len(lease.evicted),
                         "copy_lent_ms": (t4 - t3) * 1e3})
            cache.lender.take_back(lease)
            time.sleep(ns.between_s)
        stop.set()
        loader.join(30)
        cache.settle(120)
        cache.check_integrity()
    finally:
        cache.close()
    med = {k: statistics.median(r[k] for r in rows) for k in ("call_ms", "ready_ms", "copy_lent_ms")}
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "model": ns.model, "rank": ns.rank, "page_bytes": page_bytes, "pool_pages": pages,
            "give_gb": ns.give_gb, "batches": counts["batches"], "refused": counts["refused"], "repeats": rows,
            "median": med, "ready_over_copy": med["ready_ms"] / max(med["copy_lent_ms"], 1e-6)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=16, help="every adapter's rank, and the page's")
    ap.add_argument("--max-rank", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=30)
    ap.add_argument("--pool-gb", type=float, default=2.0)
    ap.add_argument("--host-gb", type=float, default=4.0)
    ap.add_argument("--give-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warm-s", type=float, default=1.0)
    ap.add_argument("--between-s", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    return ap


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="give-back-") as tmp:
        result = measure(ns, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if ns.out is not None:
        ns.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
