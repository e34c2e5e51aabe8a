"""A miss on the device store (issue 42): the real path's read of an adapter whose pages are not in the page cache,
against what the device itself gives, measured in the same run on the same files.

    python -m bench.probes.cold_device --out results/cold_device.json [--model llama-3.1-8b] [--rank 64]
        [--adapters DIR] [--threads 1,16,64] [--repeats 3] [--device auto]
    python -m bench.probes.cold_device --model tiny --rank 16 --device cpu --out /tmp/cold_device.json   # anywhere

The benchmark's device store (``bench.run --store device``) drops every adapter file's pages before each policy and
after each read (``HostTierConfig.drop_page_cache``), so a host-tier miss reads from the device. On the GPU hosts
those reads ran at 1.3-1.9 GB/s per read (bench/reports/issue-42.md), and a rank-64 8B shard took ~270 ms, more than
a router's lead hides. Whether that is the device or the path is what this measures. Each figure reads one whole
adapter file (``adapter_model.safetensors``) after dropping its pages (``POSIX_FADV_DONTNEED``):

- ``buffered_T``: ``T`` threads of 8 MiB ``preadv`` through the page cache (the kernel's readahead);
- ``willneed_T``: the same after asking for the whole file at once (``POSIX_FADV_WILLNEED``);
- ``direct_T``: ``T`` threads of 8 MiB ``preadv`` with ``O_DIRECT`` into page-aligned memory (no page cache, no
  readahead: the device's own rate at that queue depth); "unsupported" where the file system refuses ``O_DIRECT``
  (tmpfs);
- ``mmap_T``: ``T`` threads copying 8 MiB slices of the file's mapping (page faults: the shape of
  ``workers.reads.shard.read_shard``, the reader of the real path);
- ``path``: the real path: ``WorkerCache.prefetch`` of the adapter at TP 1, a host-tier miss each time (the adapter
  evicted and dropped from the host tier first) to READY, with ``drop_page_cache`` as the benchmark sets it; its
  store read alone is ``path_read`` (the record's ``disk_ms``); ``path_ahead`` and ``path_ahead_read`` the same with
  ``HostTierConfig.read_ahead`` (the file asked for whole as its read starts, ``workers.reads.shard.ask_ahead``);
  ``path_direct`` and ``path_direct_read`` with ``HostTierConfig.direct_reads`` on (the runs by ``O_DIRECT`` reads,
  ``workers.reads.positioned.read_runs_direct``); ``path_auto`` and ``path_auto_read`` with it "auto" (two warm
  stages' reads of other cold files before each load, untimed here: auto tries its ways on those, and a load goes the
  way chosen, or through the page cache while it explores, ``workers.staging.read_ways``; ``auto_ways`` is what its
  tier measured of each way and chose, ``auto_direct`` how many of its loads went by ``O_DIRECT``).

Each is the median over ``--repeats`` reads, in GB/s of the file's bytes (``path`` of the shard's). The kinds take turns
over the same few files, so each meets the device as the others do. The device under ``--adapters`` is named
(``/proc/mounts``, ``/sys/class/block``). The table ends with the path's store read over the fastest reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.probes.cold_read import parallel_pieces, parallel_read
from bench.store import drop_all_pages
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.errors import ConfigError
from workers.cache import WorkerCache, WorkerConfig
from workers.reads.shard import drop_pages
from workers.staging.host_config import HostTierConfig

ALIGN = 4096  # O_DIRECT: offsets, lengths and the buffer's address
PATHS: dict[str, dict[str, Any]] = {  # the real path's kinds: the host tier's settings each reads with
    "path": {}, "path_ahead": {"read_ahead": True}, "path_direct": {"direct_reads": "on"},
    "path_auto": {"direct_reads": "auto"}}
WEIGHTS = "adapter_model.safetensors"


def scratch(nbytes: int) -> mmap.mmap:
    """Where the references read into: page-aligned (as ``O_DIRECT`` needs), ``nbytes`` rounded up to ``ALIGN``,
    touched once here so that no read's time pays for its first-touch faults."""
    buf = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN)
    torch.frombuffer(buf, dtype=torch.uint8).zero_()
    return buf


def read_buffered(path: Path, threads: int, into: mmap.mmap, willneed: bool = False) -> int:
    """``willneed``: the whole file asked for first (``POSIX_FADV_WILLNEED``: the kernel starts reading all of it at
    once, so the threads' reads find pages that are arriving rather than each waiting for its own readahead)."""
    return _read_whole(path, threads, into, 0, os.POSIX_FADV_WILLNEED if willneed else None)


def read_direct(path: Path, threads: int, into: mmap.mmap) -> int:
    """OSError (EINVAL) where the file system refuses O_DIRECT."""
    return _read_whole(path, threads, into, os.O_DIRECT)


def _read_whole(path: Path, threads: int, into: mmap.mmap, flags: int, advice: int | None = None) -> int:
    """The file into ``into`` by ``cold_read``'s reference read (``flags``: ``O_DIRECT`` or 0; ``advice``: a
    ``posix_fadvise`` on the whole file first); its bytes, checked all read."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        if advice is not None:
            os.posix_fadvise(fd, 0, size, advice)
        # the last piece rounded up to ALIGN: the read stops at the end of the file
        got = parallel_read(fd, memoryview(into), -(-size // ALIGN) * ALIGN, threads)
    finally:
        os.close(fd)
    if got != size:
        raise RuntimeError(f"{path}: read {got} of {size} bytes" + (" with O_DIRECT" if flags else ""))
    return size


def read_mmap(path: Path, threads: int, into: mmap.mmap) -> int:
    size = path.stat().st_size
    dest = torch.frombuffer(into, dtype=torch.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        # a private mapping: read, never written; the view goes before the mapping closes
        views = [torch.frombuffer(mapped, dtype=torch.uint8)]

        def work(offset: int, length: int) -> int:
            dest[offset : offset + length].copy_(views[0][offset : offset + length])  # the GIL released
            return length

        try:
            got = parallel_pieces(size, threads, work)
        finally:
            views.clear()
    if got != size:
        raise RuntimeError(f"{path}: copied {got} of {size} bytes")
    return size


def load_phases(cache: WorkerCache, record: Any, answered: float) -> dict[str, float]:
    """A path load's phases in ms from its start (``SlotLoad.t0``): its host read's start and end
    (``HostEntry.marks``), its slot taken (``place``), its first and last copies issued, the last chunk proven
    (``disk_ms``), its last copy's event seen complete (``seen``), the caller's answer, and the copies' own span on
    the device from the first's start to the last's end (``h2d``, the record's ``h2d_ms``); ``direct`` 1 where its
    runs were read by ``O_DIRECT`` (``direct_reads`` and a cold file on a file system that takes it), else 0."""
    with cache.book.lock:
        load = cache.book.loads.get(record.slot)
    if load is None:
        return {}
    marks = [*(load.entry.marks if load.entry is not None else []), *load.marks]
    issued = [t for phase, t in marks if phase.startswith("issue ")]
    named = {phase: t for phase, t in marks if phase in ("read", "read end", "place", "seen")}
    if issued:
        named |= {"first issue": issued[0], "last issue": issued[-1]}
    out = {phase: (t - load.t0) * 1e3 for phase, t in named.items()}
    direct = float(any(phase == "direct" for phase, _ in marks))  # its runs read by O_DIRECT (1) or not (0)
    return out | {"proven": record.disk_ms, "answered": (answered - load.t0) * 1e3, "h2d": record.h2d_ms,
                  "direct": direct}


def device_of(path: Path) -> dict[str, Any]:
    """The mount and block device holding ``path`` and the queue settings that bear on a read."""
    best, info = "", {"mount": "?", "fs": "?", "source": "?"}
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            source, point, fs = line.split()[:3]
            if str(path.resolve()).startswith(point) and len(point) > len(best):
                best, info = point, {"mount": point, "fs": fs, "source": source}
    except OSError:
        return info
    name = Path(info["source"]).name
    block = Path("/sys/class/block") / name
    if block.exists():
        queue = block / "queue" if (block / "queue").exists() else block.resolve().parent / "queue"
        for key in ("rotational", "read_ahead_kb", "nr_requests", "max_sectors_kb"):
            with_key = queue / key
            if with_key.exists():
                info[key] = with_key.read_text().strip()
        model = block.resolve().parent / "device" / "model"
        if not model.exists():
            model = block / "device" / "model"
        if model.exists():
            info["model"] = model.read_text().strip()
    return info


def _catalog(root: Path, model: str, rank: int, count: int) -> AdapterCatalog:
    if not all((root / f"cd{rank}-{i:03d}" / WEIGHTS).exists() for i in range(count)):
        make_adapters(root, SynthConfig(model=model, count=count, rank=str(rank), prefix=f"cd{rank}", seed=rank))
    drop_all_pages(root)  # written to the device first: a fresh file's dirty pages would stay cached
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model=model, max_rank=rank))
    catalog.register_dir(root)
    return catalog


def measure(args: argparse.Namespace) -> dict[str, Any]:
    threads = [int(t) for t in args.threads.split(",")]
    if args.repeats < 1 or not threads or min(threads) < 1:
        raise ConfigError(f"--repeats {args.repeats} and --threads {args.threads!r} must be >= 1, e.g. --repeats 3 "
                          "--threads 1,16,64")
    base = Path(args.adapters or tempfile.mkdtemp(prefix="cold-device-"))
    root = base / f"{args.model}-r{args.rank}"  # one catalog per rank: a directory of several would exceed max_rank
    catalog = _catalog(root, args.model, args.rank, args.files)
    names = [f"cd{args.rank}-{i:03d}" for i in range(args.files)]
    specs = [catalog.get(n) for n in names]
    paths = [root / n / WEIGHTS for n in names]
    nbytes = paths[0].stat().st_size
    into = scratch(max(p.stat().st_size for p in paths))
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else (
        "cpu" if args.device == "auto" else args.device)
    kinds: dict[str, Callable[[Path], int]] = {}
    for t in threads:
        kinds[f"buffered_{t}"] = functools.partial(read_buffered, threads=t, into=into)
        kinds[f"willneed_{t}"] = functools.partial(read_buffered, threads=t, into=into, willneed=True)
        kinds[f"direct_{t}"] = functools.partial(read_direct, threads=t, into=into)
        kinds[f"mmap_{t}"] = functools.partial(read_mmap, threads=t, into=into)
    seconds: dict[str, list[float]] = {k: [] for k in (*kinds, *(f"{p}{r}" for p in PATHS for r in ("", "_read")))}
    phases: dict[str, dict[str, list[float]]] = {p: {} for p in PATHS}
    unsupported: dict[str, str] = {}
    host = HostTierConfig(host_bytes=2 * nbytes + (64 << 20), drop_page_cache=True)
    caches = {kind: WorkerCache(WorkerConfig(num_slots=1, tp=1, tp_rank=0, device=device,
                                             host=dataclasses.replace(host, **how)), catalog)
              for kind, how in PATHS.items()}
    shard = caches["path"].layout_of(names[0]).nbytes
    turn, asked = 0, 0
    try:
        for _ in range(args.repeats):
            for kind, read in [*kinds.items(), *((p, None) for p in PATHS)]:
                if kind in unsupported:
                    continue
                name, spec, path = names[turn % len(names)], specs[turn % len(specs)], paths[turn % len(paths)]
                turn += 1
                if read is None:  # the real path: a host-tier miss of a file whose pages are dropped
                    cache = caches[kind]
                    if kind == "path_auto":  # auto tries its ways on warm stages' reads only: two before each load
                        for k in (1, 2):
                            warm_stage(cache, names[(turn + k) % len(names)], specs[(turn + k) % len(specs)])
                    out_of_tiers(cache, name, spec)
                    t0 = time.perf_counter()
                    record = cache.prefetch(name).result(timeout=600)
                    seconds[kind].append(time.perf_counter() - t0)
                    if record.host_hit:
                        raise RuntimeError(f"{name}: the path's load was a host-tier hit; the probe needs a miss")
                    seconds[f"{kind}_read"].append(record.disk_ms / 1e3)
                    for phase, at in load_phases(cache, record, time.perf_counter()).items():
                        phases[kind].setdefault(phase, []).append(at)
                    cache.evict(name)
                    continue
                drop_pages(spec)
                try:
                    t0 = time.perf_counter()
                    read(path)
                    seconds[kind].append(time.perf_counter() - t0)
                except OSError as e:
                    if not kind.startswith("direct_"):
                        raise
                    unsupported[kind] = f"{type(e).__name__}: {e}"
    finally:
        asked = caches["path_ahead"].host.asked_ahead
        ways = caches["path_auto"].host.cold.ways.report()
        for cache in caches.values():
            cache.close()
    gbps = {k: (shard if k.startswith("path") else nbytes) / statistics.median(v) / 1e9
            for k, v in seconds.items() if v}
    references = {k: v for k, v in gbps.items() if not k.startswith("path")}
    best = max(references, key=references.__getitem__)
    return {"model": args.model, "rank": args.rank, "file_bytes": nbytes, "shard_bytes": shard, "device": device,
            "store": device_of(root), "adapters": str(root), "repeats": args.repeats, "GBps": gbps,
            "ms": {k: statistics.median(v) * 1e3 for k, v in seconds.items() if v}, "unsupported": unsupported,
            "best_reference": best, "path_read_over_best": gbps["path_read"] / gbps[best],
            "path_over_best": gbps["path"] / gbps[best],
            "path_ahead_read_over_best": gbps["path_ahead_read"] / gbps[best],
            "path_direct_read_over_best": gbps["path_direct_read"] / gbps[best],
            "path_direct_over_best": gbps["path_direct"] / gbps[best], "asked_ahead": asked,
            "path_auto_read_over_best": gbps["path_auto_read"] / gbps[best], "auto_ways": ways,
            "auto_direct": sum(phases["path_auto"].get("direct", [])),
            "phases_ms": {kind: {k: statistics.median(v) for k, v in got.items()} for kind, got in phases.items()}}


def out_of_tiers(cache: WorkerCache, name: str, spec: Any) -> None:
    """``name`` (``spec``) out of ``cache``'s slot and host tier and its file's pages dropped: its next read is a
    host-tier miss from the device (tmpfs keeps the pages)."""
    cache.evict(name)
    cache.host.drop_adapter(name)
    drop_pages(spec)


def warm_stage(cache: WorkerCache, name: str, spec: Any) -> None:
    """A warm stage's read of ``name`` (``spec``) into ``cache``'s host tier as a miss of a file whose pages are
    dropped, then let go: what "auto" explores its ways with (``workers.staging.read_ways``, point 3)."""
    out_of_tiers(cache, name, spec)
    with cache.host.demand.speculative():
        staged = cache.stage(name)
    if staged is None:
        raise RuntimeError(f"{name}: the probe's warm stage found no host room; the probe sizes the tier for two "
                           "shards")
    staged.result(timeout=600)
    cache.host.drop_adapter(name)


def table(out: dict[str, Any]) -> str:
    rows = ["| read | ms | GB/s |", "| --- | ---: | ---: |"]
    rows += [f"| {k} | {out['ms'][k]:.1f} | {g:.2f} |" for k, g in out["GBps"].items()]
    rows += [f"| {k} | unsupported | {why} |" for k, why in out["unsupported"].items()]
    store = ", ".join(f"{k} {v}" for k, v in out["store"].items())
    return (f"{out['model']} rank {out['rank']}: {out['file_bytes'] / 1e6:.0f} MB per file, on {store}\n"
            + "\n".join(rows)
            + f"\n\nthe path's store read / the best reference ({out['best_reference']}): "
              f"{out['path_read_over_best']:.2f}; prefetch -> READY / it: {out['path_over_best']:.2f}; with "
              f"read_ahead: {out['path_ahead_read_over_best']:.2f} ({out['asked_ahead']} reads asked ahead); with "
              f"direct_reads: {out['path_direct_read_over_best']:.2f}, to READY {out['path_direct_over_best']:.2f}; "
              f"auto: {out['path_auto_read_over_best']:.2f} ({out['auto_direct']:.0f} direct; {out['auto_ways']})\n"
            + "".join(f"\n{kind} phases (ms from the prefetch, medians): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in sorted(got.items(), key=lambda kv: kv[1]))
                      for kind, got in out.get("phases_ms", {}).items() if got))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.cold_device", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--adapters", default="", help="directory for the probe's adapters (made if missing)")
    parser.add_argument("--files", type=int, default=3, help="adapter files the reads take turns over")
    parser.add_argument("--threads", default="1,16,64", help="reader threads of the references")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto", help="the path's device: auto, cuda or cpu")
    parser.add_argument("--out", default="", help="JSON of every figure")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    out = measure(args)
    print(table(out))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
