"""Registration from an object store at scale: ``serve --adapters s3://...`` to serving N adapters (issue 44 item 6).

For each count N: N tiny adapters (``catalog.make_adapters``: copies of one with their last bytes changed, so each
is its own version) uploaded to moto's S3 server (a process of its own); in front of it a ``LatencyProxy`` that holds
every request ``--latency-ms`` on its way (``s3_local``: a store that far away). Per latency, a fresh embedded Ray
whose processes reach the store through the proxy, the service started (``start_s``) and the prefix registered as
``serve --adapters s3://...`` registers it: listed once, then read ``store_reads`` adapters at a time
(``register_s``; ``serving_s`` the two). With ``--register background`` the service serves once the prefix is
listed (``serving_s``) and registers the adapters in the background (``all_s``), ``--asks`` adapters asked for at
random meanwhile (``ask_ms``: registered on demand if the backlog has not reached them). Also per run: the
requests the store was asked per adapter (the proxy's count), and the server's own request rate in the same run
(``server_rps``: 2,000 config GETs from 32 threads, straight to the server and through the proxy), the reference a
registration is bounded by.

    python -m bench.probes.store_catalog --counts 1000,10000 --latency-ms 0,20 --out results/store_catalog.json
    python -m bench.probes.store_catalog --counts 10000 --latency-ms 0,20 --register background,wait --out F
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.probes.catalog import make_adapters, record, write_results
from bench.probes.s3_local import LatencyProxy, moto_server, upload

BUCKET = "catalog-bkt"


def server_rps(endpoint: str, keys: list[str], requests: int = 2000, threads: int = 32) -> float:
    """GETs per second the server answers to ``threads`` clients at once (small objects: ``keys`` in turn)."""
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=threads))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: s3.get_object(Bucket=BUCKET, Key=keys[i % len(keys)])["Body"].read(),
                      range(requests)))
    return requests / (time.perf_counter() - t0)


@contextlib.contextmanager
def serving(store: str, proxy: LatencyProxy, ns: argparse.Namespace, adapters: str = "",
            register: str = "wait") -> Iterator[tuple[Any, float, Any]]:
    """A fresh embedded Ray whose processes reach the store through ``proxy``, and the service started on it (one
    replica of ``--tp`` CPU workers, ``STORE`` an adapter root): (the service, seconds from ``ray.init`` to
    ``start``'s return, its catalog config). Stopped, and Ray shut down, on the way out."""
    import os

    import ray

    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.app.serve import ServeConfig, start
    from lora_cache.planner import PlannerConfig
    from workers.cache import WorkerConfig
    from workers.staging.host_config import HostTierConfig

    os.environ["AWS_ENDPOINT_URL"] = proxy.url  # every process of the cluster reaches the store through the proxy
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=ns.cpus, namespace="lora-cache", include_dashboard=False)
    try:
        catalog = CatalogConfig(adapter_roots=(store,), model="tiny", max_rank=16, store_reads=ns.store_reads)
        service = start(ServeConfig(adapters=adapters, replicas=1, tp=ns.tp, register=register), catalog,
                        PlannerConfig(), WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 26, pin=False)))
        try:
            yield service, time.perf_counter() - t0, catalog
        finally:
            service.stop()
    finally:
        ray.shutdown()


def measure(store: str, proxy: LatencyProxy, count: int, ns: argparse.Namespace) -> dict[str, Any]:
    import ray

    from lora_cache.app.serve import register_directory

    with serving(store, proxy, ns) as (service, started, catalog):
        chunks = proxy.chunks
        t1 = time.perf_counter()
        done = register_directory(service.controller, store, catalog.store_timeout_s)
        registered = time.perf_counter() - t1
        asked = proxy.chunks - chunks
        status = ray.get(service.controller.status.remote())
        failed = [d.name for d in done if d.error is not None]
        assert status["adapters"] == count and not failed, (status["adapters"], failed[:5])
    return {"register": "wait", "start_s": round(started, 2), "register_s": round(registered, 2),
            "serving_s": round(started + registered, 2), "requests_per_adapter": round(asked / count, 2)}


def measure_background(store: str, proxy: LatencyProxy, count: int, ns: argparse.Namespace) -> dict[str, Any]:
    """``serve --adapters STORE --register background``: serving once listed (``serving_s``, Ray's start included),
    ``--asks`` adapters at random then asked for in turn while the backlog runs (``ask_ms``: each request's
    registration on demand, or its lookup if the backlog came first), and every adapter registered (``all_s``)."""
    import random

    import ray

    chunks, t0 = proxy.chunks, time.perf_counter()
    with serving(store, proxy, ns, adapters=store, register="background") as (service, started, _):
        controller = service.controller
        at_serving = ray.get(controller.status.remote())["adapters"]
        names = [f"adapter-{k:05d}" for k in random.Random(0).sample(range(count), min(ns.asks, count))]
        asks = []
        for name in names:
            t = time.perf_counter()
            ray.get(controller.resolve_adapter.remote(name), timeout=120)
            asks.append((time.perf_counter() - t) * 1e3)
        while (status := ray.get(controller.status.remote()))["backlog"]["waiting"]:
            time.sleep(0.2)
        every = time.perf_counter() - t0
        asked = proxy.chunks - chunks
        assert status["adapters"] == count and not status["backlog"]["failed"], (status["adapters"], status["backlog"])
    return {"register": "background", "serving_s": round(started, 2), "registered_at_serving": at_serving,
            "ask_ms": [round(a, 1) for a in asks], "ask_ms_median": round(sorted(asks)[len(asks) // 2], 1),
            "all_s": round(every, 2), "backlog": status["backlog"], "resolver": status["resolver"],
            "requests_per_adapter": round(asked / count, 2)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.store_catalog", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1000,10000", help="comma-separated adapter counts")
    parser.add_argument("--latency-ms", default="0,20", help="comma-separated latencies added per request")
    parser.add_argument("--store-reads", type=int, default=32, help="the catalog's store_reads")
    parser.add_argument("--tp", type=int, default=2, help="workers (one replica)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the embedded Ray")
    parser.add_argument("--cache", default="/tmp/lora-cache-bench-catalog", help="where the adapters are made")
    parser.add_argument("--register", default="wait", help="comma-separated: wait (serve once every adapter is "
                        "registered), background (serve once listed)")
    parser.add_argument("--asks", type=int, default=16, help="background: adapters asked for at random once serving")
    parser.add_argument("--out", help="also write the results here (JSON)")
    ns = parser.parse_args(argv)
    counts = [int(c) for c in ns.counts.split(",") if c.strip()]
    latencies = [float(v) for v in ns.latency_ms.split(",") if v.strip()]
    results: list[dict[str, Any]] = []
    with moto_server() as endpoint:
        for count in counts:
            root = Path(ns.cache) / "tiny-r8" / str(count)
            make_adapters(root, "tiny", 8, count)
            t0 = time.perf_counter()
            upload(sorted(root.iterdir()), BUCKET, str(count))
            uploaded = time.perf_counter() - t0
            keys = [f"{count}/{d.name}/adapter_config.json" for d in sorted(root.iterdir())[:256]]
            for latency in latencies:
                with LatencyProxy(endpoint, latency / 1e3) as proxy:
                    rps = {"direct": round(server_rps(endpoint, keys)), "proxied": round(server_rps(proxy.url, keys))}
                    for mode in ns.register.split(","):
                        how = measure_background if mode == "background" else measure
                        row = {"count": count, "latency_ms": latency, "store_reads": ns.store_reads,
                               "upload_s": round(uploaded, 1), "server_rps": rps,
                               **how(f"s3://{BUCKET}/{count}", proxy, count, ns)}
                        record(row, results)
    write_results(ns.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
