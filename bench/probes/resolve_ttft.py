"""Request-time resolution, timed: a store adapter's first request to its first token, resolved on demand against
registered ahead (issue 44 item 5, the resolution's figure).

One replica of the reference engine hosted in its worker actors (the benchmark's real path), streaming, on an
embedded Ray; the adapters in moto's S3 server (a process of its own) behind a ``LatencyProxy`` that holds every
request ``--latency-ms`` (``s3_local``: a store that far away). Half of them are registered at the start (``ahead``),
half are not (``resolved``: the engine's ``submit`` has the controller register them on demand). Pairs of requests,
one of each kind, alternate which goes first; each request waits for the one before it to finish, so every one is
the first touch of its adapter: a store read and a load either way, and a resolution (a store lookup and the
registration: the config and the safetensors header) on top for ``resolved``, unless the load finds the adapter in
the host tier, or in a GPU slot, placed there ahead of demand (issue 42: a registered adapter may be; the results
count where each kind's first load read from and whether it came before its request). TTFT counts from the submit
call.
``hot`` is a second request to an adapter already loaded (the floor: no read, no load). A first request (another
registered adapter) goes before all of them, apart: the worker's first store read. Then ``--herd`` requests
for one more new name in one submit: the controller's resolver counts one lookup however many ask.

    python -m bench.probes.resolve_ttft --latency-ms 0,20 --pairs 6 --out results/resolve_ttft.json
    python -m bench.probes.resolve_ttft --model llama-3.1-8b --rank 16 --device cuda ...   # on a GPU

Each latency's pass has a disk tier of its own (a pass never reads another's copies), fetching each object in one
GET as the benchmark does (moto serves 8 ranged GETs of an object far slower than one GET of it: 1.8 s against
0.4 s for 320 MiB on this 2-core container; an 8B rank-64 adapter's first request took ~7.8 s on the GPU host in 8
ranges), and every object is read once from the server before the first pass (a server's first GETs are slower).
``--model`` and ``--rank`` size the adapters and the engine (random base weights of that model's shapes, all its
layers); ``--device cuda`` runs the engine and its cache on the GPU, the host tier pinned.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.probes.catalog import make_adapters, record, write_results
from bench.probes.s3_local import LatencyProxy, moto_server, upload

BUCKET = "resolve-bkt"
PREFIX = "tenants"


def _ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 1)


def read_all(bucket: str, prefix: str, threads: int = 8) -> float:
    """Every object under ``prefix`` read once, straight from the server (not through the proxy); the seconds taken.
    moto's first GET of an object after its upload is slower than the next (docs/known-issues.md: 1.97 s against
    0.4-0.6 s for 300 MiB on the 2-core container), so every pass comes after one read of everything."""
    import boto3

    s3 = boto3.client("s3")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda key: s3.get_object(Bucket=bucket, Key=key)["Body"].read(), keys))
    return time.perf_counter() - t0


def measure(store: str, proxy: LatencyProxy, names: list[str], ns: argparse.Namespace, disk: str,
            adapter_bytes: int) -> dict[str, Any]:
    """One latency's pass (the module's docstring); ``disk``: a fresh disk tier, so no pass reads another's copies;
    ``adapter_bytes``: one adapter's, which sizes the host tier (8 of them)."""
    import ray

    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.app.serve import ServeConfig, start
    from lora_cache.planner import PlannerConfig
    from lora_cache.vocab import WorkerId
    from workers.cache import WorkerConfig
    from workers.engine import EngineConfig, Request
    from workers.staging.disk_tier import DiskTierConfig
    from workers.staging.host_config import HostTierConfig

    os.environ["AWS_ENDPOINT_URL"] = proxy.url  # every process of the cluster reaches the store through the proxy
    pairs = ns.pairs
    ahead, new, herd, warm = names[:pairs], names[pairs:2 * pairs], names[2 * pairs], names[2 * pairs + 1]
    ray.init(address="local", num_cpus=ns.cpus, namespace="lora-cache", include_dashboard=False)
    try:
        gpu = ns.device != "cpu"
        host = HostTierConfig(host_bytes=max(1 << 26, 8 * adapter_bytes), pin=gpu)
        service = start(ServeConfig(replicas=1, tp=1, gpus=gpu),
                        CatalogConfig(adapter_roots=(store,), model=ns.model, max_rank=ns.rank),
                        PlannerConfig(policy="queue"),
                        WorkerConfig(num_slots=4, host=host, device=ns.device,
                                   disk=DiskTierConfig(disk_cache=disk, fetch_part_bytes=0)))
        ctl = service.controller
        done = ray.get(ctl.register_adapters.remote([(n, f"{store}/{n}") for n in [*ahead, warm]]), timeout=120)
        assert not [d.name for d in done if d.error is not None], done
        rank = service.workers[WorkerId("replica-0", 0)]
        engine = EngineConfig(adapters=store, model=ns.model, device=ns.device, tp=1, num_slots=4, max_adapters=4,
                              max_running=8, max_prefill_tokens=64, max_seq_len=64, max_rank=ns.rank,
                              admission="overlap", host=host)
        meet = ray.get(rank.engine_rendezvous.remote(1), timeout=60)
        ray.get(rank.engine_build.remote(engine, meet), timeout=300)
        start_wall = time.time()
        run = rank.engine_run.remote([], start_wall, 0, False, True)
        kinds: dict[int, str] = {}
        finished: set[int] = set()

        def serve(rid: int, kind: str, adapter: str, count: int = 1) -> None:
            arrival = time.time() - start_wall  # TTFT counts from here: a resolution inside the submit counts
            rids = list(range(rid, rid + count))
            ray.get(rank.engine_submit.remote([Request(r, adapter, 8, 2, arrival) for r in rids]), timeout=120)
            kinds.update(dict.fromkeys(rids, kind))
            while not set(rids) <= finished:
                got = ray.get(rank.engine_finished.remote(5.0), timeout=60)
                assert got is not None, "the run ended early"
                finished.update(got)

        serve(0, "warm-up", warm)  # the worker's first store read (its client made, its connections opened): apart
        rid = 1
        for i in range(pairs):
            order = [("ahead", ahead[i]), ("resolved", new[i])]
            for kind, adapter in order if i % 2 == 0 else order[::-1]:
                serve(rid, kind, adapter)
                serve(rid + 1, "hot", adapter)
                rid += 2
        lookups = ray.get(ctl.status.remote(), timeout=30)["resolver"]["lookups"]
        serve(rid, "herd", herd, ns.herd)
        resolver = ray.get(ctl.status.remote(), timeout=30)["resolver"]
        ray.get(rank.engine_end_stream.remote(), timeout=60)
        result = ray.get(run, timeout=300)
        loads = ray.get(rank.load_log.remote(), timeout=30)  # each load: from the host tier (warmed) or the store
        service.stop()
    finally:
        ray.shutdown()
    ttft: dict[str, list[float]] = {}
    for r in result.records:
        assert r.ok, (r.rid, r.error)
        ttft.setdefault(kinds[r.rid], []).append(r.ttft_s)
    out = {f"{k}_ttft_ms": _ms(v) for k, v in sorted(ttft.items())}
    out["resolved_over_ahead"] = round(statistics.median(ttft["resolved"]) / statistics.median(ttft["ahead"]), 2)
    out["resolution_ms"] = round(out["resolved_ttft_ms"] - out["ahead_ttft_ms"], 1)
    kind_of = {r.adapter: kinds[r.rid] for r in result.records if kinds[r.rid] != "hot"}
    asked = {r.adapter: start_wall + r.arrival_s for r in result.records if kinds[r.rid] in ("ahead", "resolved")}
    first: dict[str, tuple[float, bool]] = {}
    for t, rec in loads:
        first.setdefault(rec.adapter, (t, rec.host_hit))
    for k in ("ahead", "resolved"):  # of ``pairs`` each: where its first load read from, and whether it came first
        mine = [a for a, kind in kind_of.items() if kind == k and a in first]
        out[f"{k}_loaded_from_host"] = sum(first[a][1] for a in mine)
        out[f"{k}_loaded_before_asked"] = sum(first[a][0] < asked[a] for a in mine)
    out["herd_lookups"] = resolver["lookups"] - lookups  # one new name asked for by ns.herd requests at once
    out["resolver"] = resolver
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.resolve_ttft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-ms", default="0,20", help="comma-separated latencies added per store request")
    parser.add_argument("--pairs", type=int, default=6, help="requests of each kind (ahead, resolved)")
    parser.add_argument("--herd", type=int, default=32, help="requests for one new name in one submit")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the embedded Ray")
    parser.add_argument("--cache", default="/tmp/lora-cache-bench-resolve", help="where the adapters are made")
    parser.add_argument("--model", default="tiny", help="the adapters' and the engine's model shapes")
    parser.add_argument("--rank", type=int, default=8, help="the adapters' LoRA rank")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the engine and its cache on the GPU")
    parser.add_argument("--out", help="also write the results here (JSON)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    latencies = [float(v) for v in ns.latency_ms.split(",") if v.strip()]
    count = 2 * ns.pairs + 2
    root = Path(ns.cache) / f"{ns.model}-r{ns.rank}" / str(count)
    adapter_bytes = make_adapters(root, ns.model, ns.rank, count) // count
    names = sorted(d.name for d in root.iterdir())
    results: list[dict[str, Any]] = []
    with moto_server() as endpoint, tempfile.TemporaryDirectory(prefix="resolve-ttft-disk-") as disks:
        upload(sorted(root.iterdir()), BUCKET, PREFIX)
        read_s = read_all(BUCKET, PREFIX)  # every object read once: no pass meets the server's first GETs
        print(f"every object read once from the server in {read_s:.1f} s", file=sys.stderr)
        for i, latency in enumerate(latencies):
            with LatencyProxy(endpoint, latency / 1e3) as proxy:
                row = {"latency_ms": latency, "pairs": ns.pairs, "herd": ns.herd, "model": ns.model, "rank": ns.rank,
                       "device": ns.device,
                       **measure(f"s3://{BUCKET}/{PREFIX}", proxy, names, ns, f"{disks}/{i}", adapter_bytes)}
            record(row, results)
    write_results(ns.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
