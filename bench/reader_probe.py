"""How much an adapter read slows the engine steps beside it in the same process.

A worker reads shards on its reader threads while the engine's thread launches a step's kernels from
Python; every launch releases and retakes the GIL, so a reader that holds the GIL while it copies makes
each launch wait. This times a launch-bound step (``--ops`` small kernels, then a synchronize: what an
eager prefill is on the H200) alone and beside 1..N back-to-back reads of a Llama-3.1-8B rank-64 shard,
for three readers: ``mmap`` (workers.reader.read_shard: the mapped file's slices copied in one call with
the GIL released), ``preadv`` (one ``os.preadv`` per matrix or row, the GIL released during each) and
``get_slice`` (safetensors' sliced reads, the reader before 2026-11-22), the last two kept as references.

    python -m bench.reader_probe --out reader_probe.json [--adapters DIR] [--tp 1,2] [--readers 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lora_cache.catalog import AdapterCatalog, CatalogConfig
from lora_cache.peft import AdapterSpec
from lora_cache.shards import ShardLayout, shard_layout
from lora_cache.synth import SynthConfig, make_adapters
from workers.reader import read_shard, tensor_index


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


READERS: dict[str, Callable[[AdapterSpec, ShardLayout, torch.Tensor], int]] = {
    "mmap": read_shard, "preadv": preadv_read, "get_slice": get_slice_read}


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


def probe(specs: list[AdapterSpec], catalog: AdapterCatalog, reader: str, tp: int, readers: int,
          step: Callable[[], float], steps: int) -> dict[str, Any]:
    fn = READERS[reader]
    pin = torch.cuda.is_available()
    layout = shard_layout(specs[0], catalog.shape, tp, 0, torch.bfloat16)
    dests = [torch.empty(layout.numel, dtype=torch.bfloat16, pin_memory=pin) for _ in range(readers)]
    t0 = time.perf_counter()
    fn(specs[0], layout, dests[0])
    alone_ms = (time.perf_counter() - t0) * 1e3
    idle = [step() for _ in range(steps)]
    stop, reads = threading.Event(), []

    def loop(i: int) -> None:
        spec = specs[i % len(specs)]
        lay = shard_layout(spec, catalog.shape, tp, 0, torch.bfloat16)
        while not stop.is_set():
            t = time.perf_counter()
            fn(spec, lay, dests[i])
            reads.append(time.perf_counter() - t)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(readers)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    busy = []
    for _ in range(steps):
        busy.append(step())
        time.sleep(0.002)
    stop.set()
    for t in threads:
        t.join()
    busy.sort()
    return {"reader": reader, "tp": tp, "readers": readers, "read_alone_ms": alone_ms,
            "read_beside_ms": statistics.median(reads) * 1e3 if reads else 0.0,
            "step_idle_ms": statistics.median(idle) * 1e3, "step_beside_ms": statistics.median(busy) * 1e3,
            "step_beside_p90_ms": busy[int(0.9 * (len(busy) - 1))] * 1e3,
            "slowdown": statistics.median(busy) / statistics.median(idle)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--adapters", default="/tmp/reader-probe-adapters")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--readers", default="1,2")
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    root = Path(args.adapters)
    if not root.exists():
        make_adapters(root, SynthConfig(model="llama-3.1-8b", count=2, rank="64"))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model="llama-3.1-8b", max_rank=64))
    specs = catalog.register_dir(root)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    step = launch_step(device, args.ops)
    step()
    rows = [probe(specs, catalog, reader, tp, n, step, args.steps)
            for tp in map(int, args.tp.split(",")) for n in map(int, args.readers.split(","))
            for reader in READERS]
    for r in rows:
        print(f"tp {r['tp']} x{r['readers']} {r['reader']:9s} read {r['read_alone_ms']:6.1f} ms alone, "
              f"{r['read_beside_ms']:6.1f} beside; step {r['step_idle_ms']:5.1f} ms idle, {r['step_beside_ms']:5.1f} "
              f"beside (p90 {r['step_beside_p90_ms']:5.1f}): {r['slowdown']:.2f}x", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": str(torch.cuda.get_device_name() if device.type == "cuda"
                                                         else "cpu"), "ops": args.ops, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
