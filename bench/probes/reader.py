"""How much an adapter read slows the engine steps beside it in the same process.

A worker reads shards on its reader threads while the engine's thread launches a step's kernels from
Python; every launch releases and retakes the GIL, so a reader that holds the GIL while it copies makes
each launch wait. This times a launch-bound step (``--ops`` small kernels, then a synchronize: what an
eager prefill is on the H200) alone and beside 1..N back-to-back reads of a Llama-3.1-8B rank-64 shard,
for three readers: ``mmap`` (workers.reads.shard.read_shard: the mapped file's slices copied in one call with
the GIL released), ``preadv`` (one ``os.preadv`` per matrix or row, the GIL released during each) and
``get_slice`` (safetensors' sliced reads, the reader before 2026-11-22), the last two kept as references.
Three more separate the causes of what is left: ``views`` (the mmap reader's Python alone: the views
built, nothing copied: its share of the GIL), ``mmap-h2d`` (the read, then its copy to the GPU on a side
stream, waited for by event: a whole load) and ``mmap-proc`` (the mmap reader in a bare child process:
no GIL shared, only the cores, memory and page cache). ``process`` is what a GPU worker now runs:
``workers.reads.processes`` processes reading into a shared, pinned arena, each reader thread waiting on
one. ``--threads`` repeats the set at each torch intra-op thread count (a copy on the host is split
over that many OpenMP threads; Ray workers run with 1).

    python -m bench.probes.reader --out reader_probe.json [--adapters DIR] [--tp 1,2] [--readers 1,2]
        [--threads 1,16] [--kinds mmap,views,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shards import ShardLayout, shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.vocab import AdapterKey
from workers.reads.proof import tensor_index
from workers.reads.shard import read_shard
from workers.staging.arena import ALIGN, Block, HostArena
from workers.staging.host_tier import HostEntry
from workers.staging.tier_reads import ProcessReads


def get_slice_read(spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor) -> int:
    """The former reader: safetensors ``get_slice`` per matrix (the copy out of the file holds the GIL)."""
    read = 0
    with safe_open(str(spec.weights), framework="pt") as f:
        for e in layout.entries:
            part = f.get_slice(e.key)[e.rows, e.cols]
            dest[e.offset : e.offset + e.numel].view(e.shape).copy_(part)
            read += part.numel() * part.element_size()
    return read


def preadv_read(spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor) -> int:
    """``os.preadv`` from the file straight into each matrix's place (a column slice row by row)."""
    index = tensor_index(str(spec.weights), spec.version, spec.file_bytes)
    fd, read = os.open(spec.weights, os.O_RDONLY), 0
    try:
        for e in layout.entries:
            t = index[e.key]
            raw = dest[e.offset : e.offset + e.numel].view(torch.uint8).numpy()
            size, cols = t.dtype.itemsize, t.shape[1]
            first, width = t.start + (e.rows.start * cols + e.cols.start) * size, e.shape[1] * size
            spans = [(raw, first)] if e.shape[1] == cols else [
                (raw[i * width : (i + 1) * width], first + i * cols * size) for i in range(e.shape[0])]
            for into, offset in spans:
                read += os.preadv(fd, [memoryview(into)], offset)  # type: ignore[arg-type]  # page cache: never short
    finally:
        os.close(fd)
    return read


def views_only(spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor) -> int:
    """The mmap reader's Python without its copy: the header lookup and every slice's view, built and dropped."""
    index = tensor_index(str(spec.weights), spec.version, spec.file_bytes)
    with open(spec.weights, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    file = torch.frombuffer(mapped, dtype=torch.uint8)
    views = []
    for e in layout.entries:
        t = index[e.key]
        whole = file[t.start : t.start + math.prod(t.shape) * t.dtype.itemsize].view(t.dtype)
        views.append((whole.view(t.shape)[e.rows, e.cols], dest[e.offset : e.offset + e.numel].view(e.shape)))
    del views, file
    mapped.close()
    return 0


_SIDE: dict[tuple[int, int], Any] = {}


def mmap_h2d(spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor) -> int:
    """A whole load: the mmap read into pinned memory, then one copy to the GPU on a side stream, waited
    for by its event (the synchronize releases the GIL)."""
    read = read_shard(spec, layout, dest)
    key = (threading.get_ident(), dest.numel())
    if key not in _SIDE:
        _SIDE[key] = (torch.cuda.Stream(), torch.empty_like(dest, device="cuda"))
    stream, gpu = _SIDE[key]
    with torch.cuda.stream(stream):
        gpu.copy_(dest, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return read


def _child_reads(path: str, adapters: str, tp: int, threads: int, stop: Any, ready: Any, times: Any) -> None:
    """A child process: the mmap reader, back to back, until ``stop`` is set; each read's seconds to ``times``."""
    torch.set_num_threads(threads)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(adapters,), model="llama-3.1-8b", max_rank=64))
    spec = next(s for s in catalog.register_dir(Path(adapters)) if str(s.weights) == path)
    layout = shard_layout(spec, catalog.shape, tp, 0, torch.bfloat16)
    dest = torch.empty(layout.numel, dtype=torch.bfloat16)
    ready.put(os.getpid())
    while not stop.is_set():
        times.put(_timed(lambda: read_shard(spec, layout, dest)))


@contextlib.contextmanager
def process_reads(count: int, nbytes: int) -> Iterator[Callable[[AdapterSpec, ShardLayout, torch.Tensor], int]]:
    """``count`` reader processes over a shared arena of ``count`` blocks of ``nbytes``; the returned reader
    takes an idle process and its block (a worker's ``ProcessReads``); ``dest`` is not used."""
    arena = HostArena(count * -(-nbytes // ALIGN) * ALIGN, pin=torch.cuda.is_available(), shared=True)
    reads = ProcessReads(arena, count, "sample")
    blocks: queue.SimpleQueue[Block] = queue.SimpleQueue()
    for _ in range(count):
        block = arena.alloc(nbytes)
        assert block is not None
        blocks.put(block)

    def read(spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor) -> int:
        block = blocks.get()
        try:
            entry = HostEntry(AdapterKey(spec.name, spec.version), layout, block, dest, Future())
            return reads.read(spec, entry)
        finally:
            blocks.put(block)

    try:
        yield read
    finally:
        reads.close()
        arena.close()


READERS: dict[str, Callable[[AdapterSpec, ShardLayout, torch.Tensor], int]] = {
    "mmap": read_shard, "preadv": preadv_read, "get_slice": get_slice_read, "views": views_only,
    "mmap-h2d": mmap_h2d}
KINDS = ("process", *READERS, "mmap-proc")  # process: workers' ProcessReads; mmap-proc: a bare child process


def launch_step(device: torch.device, ops: int) -> Callable[[], float]:
    x, y = torch.ones(256, device=device), torch.ones(256, device=device)

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(ops):
            torch.add(x, y, out=x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    return step


def probe(specs: list[AdapterSpec], catalog: AdapterCatalog, kind: str, tp: int, readers: int,
          step: Callable[[], float], steps: int, adapters: str = "") -> dict[str, Any]:
    """One row: ``step`` alone, then beside ``readers`` back-to-back reads of ``kind``."""
    if kind == "mmap-proc":
        return probe_children(specs, catalog, tp, readers, step, steps, adapters)
    if kind != "process":
        return probe_threads(specs, catalog, kind, tp, readers, step, steps, READERS[kind])
    with process_reads(readers, shard_layout(specs[0], catalog.shape, tp, 0, torch.bfloat16).nbytes) as fn:
        return probe_threads(specs, catalog, kind, tp, readers, step, steps, fn)


def probe_threads(specs: list[AdapterSpec], catalog: AdapterCatalog, kind: str, tp: int, readers: int,
                  step: Callable[[], float], steps: int,
                  fn: Callable[[AdapterSpec, ShardLayout, torch.Tensor], int]) -> dict[str, Any]:
    """Reads by ``fn``, each reader on a thread of this process."""
    pin = torch.cuda.is_available()
    layout = shard_layout(specs[0], catalog.shape, tp, 0, torch.bfloat16)
    dests = [torch.empty(layout.numel, dtype=torch.bfloat16, pin_memory=pin) for _ in range(readers)]
    if kind == "process":  # each reader process started (FIFO: one read each) before the clock
        for _ in range(readers):
            fn(specs[0], layout, dests[0])
    alone_ms = _timed(lambda: fn(specs[0], layout, dests[0]))
    stop, reads = threading.Event(), []

    def loop(i: int) -> None:
        spec = specs[i % len(specs)]
        lay = shard_layout(spec, catalog.shape, tp, 0, torch.bfloat16)
        while not stop.is_set():
            reads.append(_timed(lambda: fn(spec, lay, dests[i])))

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(readers)]

    def start() -> None:
        for t in threads:
            t.start()

    def end() -> None:
        stop.set()
        for t in threads:
            t.join()

    idle, busy = _beside(step, steps, start, end)
    return _row(kind, tp, readers, alone_ms, reads, idle, busy)


def probe_children(specs: list[AdapterSpec], catalog: AdapterCatalog, tp: int, readers: int,
                   step: Callable[[], float], steps: int, adapters: str) -> dict[str, Any]:
    """The mmap reader in bare child processes (spawned: no CUDA state is forked), at this process's
    intra-op thread count."""
    ctx = mp.get_context("spawn")
    layout = shard_layout(specs[0], catalog.shape, tp, 0, torch.bfloat16)
    dest = torch.empty(layout.numel, dtype=torch.bfloat16)
    alone_ms = _timed(lambda: read_shard(specs[0], layout, dest))
    stop, ready, times = ctx.Event(), ctx.Queue(), ctx.Queue()
    children = [ctx.Process(target=_child_reads, args=(str(specs[i % len(specs)].weights), adapters, tp,
                                                       torch.get_num_threads(), stop, ready, times), daemon=True)
                for i in range(readers)]

    def start() -> None:
        for c in children:
            c.start()
        for _ in children:
            ready.get(timeout=120)  # each child's imports and catalog done before the clock

    def end() -> None:
        stop.set()
        for c in children:
            c.join(timeout=60)

    idle, busy = _beside(step, steps, start, end)
    reads = []
    while not times.empty():
        reads.append(times.get())
    return _row("mmap-proc", tp, readers, alone_ms, reads, idle, busy)


def _timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _beside(step: Callable[[], float], steps: int, start: Callable[[], None],
            end: Callable[[], None]) -> tuple[list[float], list[float]]:
    """``steps`` steps alone, then ``steps`` more between ``start`` and ``end`` of the reads."""
    idle = [step() for _ in range(steps)]
    start()
    time.sleep(0.05)
    busy = []
    for _ in range(steps):
        busy.append(step())
        time.sleep(0.002)
    end()
    return idle, busy


def _row(kind: str, tp: int, readers: int, alone_s: float, reads: list[float], idle: list[float],
         busy: list[float]) -> dict[str, Any]:
    busy = sorted(busy)
    return {"reader": kind, "tp": tp, "readers": readers, "read_alone_ms": alone_s * 1e3,
            "read_beside_ms": statistics.median(reads) * 1e3 if reads else 0.0,
            "step_idle_ms": statistics.median(idle) * 1e3, "step_beside_ms": statistics.median(busy) * 1e3,
            "step_beside_p90_ms": busy[int(0.9 * (len(busy) - 1))] * 1e3,
            "slowdown": statistics.median(busy) / statistics.median(idle), "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--adapters", default="/tmp/reader-probe-adapters")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--readers", default="1,2")
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", default="", help="torch intra-op thread counts to repeat the set at (default: as is)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"readers to probe, from {', '.join(KINDS)}")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"--kinds: {unknown} unknown; choose from {', '.join(KINDS)}")
    if not torch.cuda.is_available():
        kinds = [k for k in kinds if k != "mmap-h2d"]
    root = Path(args.adapters)
    if not root.exists():
        make_adapters(root, SynthConfig(model="llama-3.1-8b", count=2, rank="64"))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model="llama-3.1-8b", max_rank=64))
    specs = catalog.register_dir(root)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    step = launch_step(device, args.ops)
    step()
    rows = []
    for threads in [int(t) for t in args.threads.split(",") if t] or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        for tp in map(int, args.tp.split(",")):
            for n in map(int, args.readers.split(",")):
                for reader in kinds:
                    r = probe(specs, catalog, reader, tp, n, step, args.steps, str(root))
                    rows.append(r)
                    print(f"threads {r['threads']} tp {r['tp']} x{r['readers']} {r['reader']:9s} "
                          f"read {r['read_alone_ms']:6.1f} ms alone, {r['read_beside_ms']:6.1f} beside; "
                          f"step {r['step_idle_ms']:5.1f} ms idle, {r['step_beside_ms']:5.1f} beside "
                          f"(p90 {r['step_beside_p90_ms']:5.1f}): {r['slowdown']:.2f}x", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": str(torch.cuda.get_device_name() if device.type == "cuda"
                                                         else "cpu"), "ops": args.ops, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
