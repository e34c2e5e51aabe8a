"""Adapters from an object store (issue 29, item 4): cold fetch throughput against the server's raw GET
throughput in the same run, each rank's byte ranges against one whole-object fetch per node, and prefetch ->
READY for an adapter in the store (disk tier cold, and warm) against one on local disk.

    python -m bench.probes.store_read --model llama-3.1-8b --rank 16 --out /tmp/store.json
        [--endpoint URL] [--repeats 3] [--parallel 1,4,8] [--tp 1,2,4]

Without ``--endpoint`` it starts moto's S3 server (``python -m moto.server``) as its own process on 127.0.0.1
(no authentication) and stops it at the end; with one, AWS_* credentials come from the environment. One
adapter of the shape and rank is written, uploaded, and measured (medians over ``--repeats``):

(a) ``raw_get``: the object by one plain GET, its body read into memory (no write, no check): the server's
    raw GET throughput on this link; ``get, readinto``: the same, read from the socket into one reused buffer
    (no copy: the fastest raw read; the pairs of (b) take the faster of the two); ``raw_ranged``: the same
    bytes by ``P`` parallel ranged GETs of 8 MiB;
(b) ``fetch``: the disk tier's cold fetch (``DiskTier.held`` with an empty directory: ``If-Match`` ranged GETs,
    written with ``pwrite``, block CRCs, fsync, the proof written) at each ``P`` of ``--parallel``;
    ``fetch_over_raw`` = its throughput over the best raw one (goal >= 0.8);
(c) ``ranges``: each rank of TP ``t`` fetching only the byte ranges of its shard (the layout's contiguous runs
    and column-slice spans, adjacent ranges merged when under 64 KiB apart), all ``t`` ranks at once with
    ``P`` = 8 GETs each, against ``whole``: one fetch of the whole object for the node (docs/decisions.md);
(d) ``ready``: ``WorkerCache.prefetch`` -> READY (CPU, one rank): the local file (page cache warm), the store
    with a cold disk tier, and the store with the copy already on disk (host tier emptied before each).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.store import moto_server  # one moto server start for the job and the probe
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import WEIGHTS_FILE
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.store import client
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.vocab import AdapterKey
from workers.cache import WorkerCache, WorkerConfig
from workers.reads.plan import plan_tasks
from workers.reads.proof import tensor_index
from workers.staging.disk_tier import DiskTier, DiskTierConfig
from workers.staging.host_config import HostTierConfig

BUCKET = "probe-adapters"
PART = 8 << 20
GAP = 64 << 10  # ranges closer than this are fetched as one


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> float:
    out = []
    for _ in range(repeats):
        if before is not None:
            before()
        out.append(timed(fn))
    return statistics.median(out)


def raw_get(s3: Any, key: str) -> int:
    return len(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def raw_get_into(s3: Any, key: str) -> int:
    """The object by one plain GET, read straight from the socket into one reused 1 MiB buffer and dropped
    (no write, no check): the fastest raw read this client has (``body.read()`` copies and joins)."""
    body = s3.get_object(Bucket=BUCKET, Key=key)["Body"]
    fp, view, n = body._raw_stream._fp, memoryview(bytearray(1 << 20)), 0
    while got := fp.readinto(view):
        n += got
    body._raw_stream.release_conn()
    return n


def ranged(s3: Any, key: str, spans: list[tuple[int, int]], parallel: int) -> int:
    def one(span: tuple[int, int]) -> int:
        start, n = span
        return len(s3.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{start + n - 1}")["Body"].read())

    with ThreadPoolExecutor(parallel) as pool:
        return sum(pool.map(one, spans))


def shard_ranges(spec: Any, shape: Any, tp: int, rank: int) -> list[tuple[int, int]]:
    """(start, bytes) of the file ranges rank ``rank`` of TP ``tp`` needs, adjacent ones merged."""
    layout = shard_layout(spec, shape, tp, rank, __import__("torch").bfloat16)
    index = tensor_index(spec.source.path, spec.version, spec.file_bytes)
    spans = []
    for task in plan_tasks(index, layout.entries, layout.dtype, 1 << 40):
        spans += [(r.start, r.nbytes) for r in task.runs]
        spans += [(s.start, (s.rows - 1) * s.stride + s.width) for s in task.strided]
    merged: list[tuple[int, int]] = []
    for start, n in sorted(spans):
        if merged and start <= merged[-1][0] + merged[-1][1] + GAP:
            first = merged[-1][0]
            merged[-1] = (first, max(merged[-1][0] + merged[-1][1], start + n) - first)
        else:
            merged.append((start, n))
    return merged


def measure(ns: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "probe")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "probe")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    work = Path(tempfile.mkdtemp(prefix="store-probe-"))
    try:
        adapter = make_adapters(work / "local", SynthConfig(model=ns.model, count=1, rank=str(ns.rank)))[0]
        s3 = client(60.0, pool=64)
        with contextlib.suppress(Exception):
            s3.create_bucket(Bucket=BUCKET)
        for f in adapter.iterdir():
            s3.put_object(Bucket=BUCKET, Key=f"p/{adapter.name}/{f.name}", Body=f.read_bytes())
        key = f"p/{adapter.name}/{WEIGHTS_FILE}"
        size = (adapter / WEIGHTS_FILE).stat().st_size
        out: dict[str, Any] = {"model": ns.model, "rank": ns.rank, "object_bytes": size, "endpoint": endpoint}
        gbps = lambda secs: size / secs / 1e9  # noqa: E731
        raw = {
            "get": gbps(median(lambda: raw_get(s3, key), ns.repeats)),
            "get, readinto": gbps(median(lambda: raw_get_into(s3, key), ns.repeats)),
        }
        parts = [(s, min(PART, size - s)) for s in range(0, size, PART)]
        for p in ns.parallel:
            raw[f"ranged x{p}"] = gbps(median(functools.partial(ranged, s3, key, parts, p), ns.repeats))
        out["raw_gbps"] = raw
        store_cat = AdapterCatalog(CatalogConfig(adapter_roots=(f"s3://{BUCKET}/p",), model=ns.model, max_rank=ns.rank))
        spec = store_cat.register(adapter.name, f"s3://{BUCKET}/p/{adapter.name}")
        disk = work / "disk"
        fetch = {}
        ways = [(f"x{p} of 8 MiB", p, PART) for p in ns.parallel] + [("one GET", 1, 0)]
        for label, p, part in ways:
            tier = DiskTier(DiskTierConfig(disk_cache=str(disk), fetch_parallel=p, fetch_part_bytes=part), 60.0)

            def cold(tier: DiskTier = tier) -> None:
                with tier.held(spec):
                    pass

            fetch[label] = gbps(median(cold, ns.repeats, lambda: shutil.rmtree(disk, ignore_errors=True)))
        out["fetch_gbps"] = fetch
        out["fetch_over_raw"] = max(fetch.values()) / max(raw.values())
        best = max(ways, key=lambda w: fetch[w[0]])
        out["paired"] = paired(s3, key, spec, disk, best, ns.repeats)
        # (c) each rank's ranges vs one whole object per node
        local_cat = AdapterCatalog(
            CatalogConfig(adapter_roots=(str(adapter.parent),), model=ns.model, max_rank=ns.rank)
        )
        local_spec = local_cat.register(adapter.name, adapter)
        shape = local_cat.shape
        best = max(ways, key=lambda w: fetch[w[0]])  # the whole object as the fastest way fetched it
        tier = DiskTier(DiskTierConfig(disk_cache=str(disk), fetch_parallel=best[1], fetch_part_bytes=best[2]), 60.0)

        def whole() -> None:
            with tier.held(spec):
                pass

        whole_s = median(whole, ns.repeats, lambda: shutil.rmtree(disk, ignore_errors=True))
        ranges = {}
        for tp in ns.tp:
            per_rank = [shard_ranges(local_spec, shape, tp, r) for r in range(tp)]

            def all_ranks(per_rank: list[list[tuple[int, int]]] = per_rank) -> None:
                with ThreadPoolExecutor(len(per_rank)) as pool:
                    list(pool.map(ranged, [s3] * len(per_rank), [key] * len(per_rank), per_rank, [8] * len(per_rank)))

            ranges[f"tp{tp}"] = {
                "seconds": median(all_ranks, ns.repeats),
                "requests": sum(len(r) for r in per_rank),
                "bytes": sum(n for r in per_rank for _, n in r),
            }
        out["ranges"] = ranges
        out["whole"] = {"seconds": whole_s, "requests": len(parts) if best[2] else 1, "bytes": size, "way": best[0]}
        # (d) prefetch -> READY
        out["ready_ms"] = ready_times(ns, local_cat, store_cat, adapter.name, work, best[1], best[2])
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def paired(s3: Any, key: str, spec: Any, disk: Path, way: tuple[str, int, int], repeats: int) -> dict[str, Any]:
    """The fastest fetch and a raw GET back to back, ``repeats`` times: the ratio of each pair (the machine's
    load drifts between measurements taken minutes apart), and its median."""
    tier = DiskTier(DiskTierConfig(disk_cache=str(disk), fetch_parallel=way[1], fetch_part_bytes=way[2]), 60.0)
    ratios = []
    for _ in range(repeats):
        shutil.rmtree(disk, ignore_errors=True)
        raw_s = min(timed(lambda: raw_get(s3, key)), timed(lambda: raw_get_into(s3, key)))  # the faster raw read

        def cold() -> None:
            with tier.held(spec):
                pass

        ratios.append(raw_s / timed(cold))
    return {"way": way[0], "fetch_over_raw": statistics.median(ratios), "each": ratios}


def ready_times(
    ns: argparse.Namespace,
    local_cat: AdapterCatalog,
    store_cat: AdapterCatalog,
    name: str,
    work: Path,
    parallel: int = 8,
    part: int = PART,
) -> dict[str, float]:
    out = {}
    spec = store_cat.get(name)
    host = HostTierConfig(host_bytes=max(64 << 20, 2 * spec.file_bytes), read_threads=2, pin=False)
    for label, catalog, clear in (
        ("local file", local_cat, False),
        ("store, disk tier cold", store_cat, True),
        ("store, disk tier warm", store_cat, False),
    ):
        disk = work / "ready-disk"
        cache = WorkerCache(
            WorkerConfig(
                num_slots=1,
                device="cpu",
                host=host,
                disk=DiskTierConfig(disk_cache=str(disk), fetch_parallel=parallel, fetch_part_bytes=part),
            ),
            catalog,
        )
        try:
            cache.prefetch(name).result(timeout=300)  # warm-up: page cache, plans; the disk tier filled
            times = []
            for _ in range(ns.repeats):
                cache.evict(name)
                cache.host.drop(AdapterKey(name, spec.version))  # a host-tier miss each time
                if clear:
                    for p in disk.glob("*.safetensors"):
                        p.unlink()
                t0 = time.perf_counter()
                cache.prefetch(name).result(timeout=300)
                times.append((time.perf_counter() - t0) * 1e3)
            out[label] = statistics.median(times)
        finally:
            cache.close()
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--endpoint", default="", help="an S3-compatible endpoint (default: start moto's server)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parallel", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument(
        "--tp",
        type=lambda s: [int(x) for x in s.split(",") if int(x) > 0],
        default=[1, 2, 4],
        help="TP sizes whose per-rank ranges are measured (0: none)",
    )
    ap.add_argument("--out", default="")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = build_parser().parse_args(argv)
    with contextlib.ExitStack() as stack:
        endpoint = ns.endpoint or stack.enter_context(moto_server())
        out = measure(ns, endpoint)
    print(json.dumps(out, indent=2))
    if ns.out:
        Path(ns.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
