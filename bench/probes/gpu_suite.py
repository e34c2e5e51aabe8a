"""Data-path measurements on a GPU, in one run (issue: the worker data path).

    python -m bench.probes.gpu_suite --out DIR [--model llama-3.1-8b] [--ranks 8,16,32,64] [--tps 1,2]

1. load: H2D of a packed shard through WorkerCache (host-tier hit, event-timed) / a plain pinned
   memcpy of the same bytes on the same stream, interleaved in the same run (goal >= 0.90).
2. disk: disk -> pinned read of one rank's shard (get_slice reads) vs a sequential read of the same
   number of bytes of the file, warm (page cache) and cold (posix_fadvise DONTNEED first).
3. overlap: a loop of bf16 GEMMs of the model's projection shapes, with shard loads running beside it
   on the copy stream vs alone (goal <= 1.03x).
Prints a markdown table last and writes every figure to DIR/gpu_suite.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.shapes import MODULE_ORDER
from lora_cache.adapters.synth import SynthConfig, make_adapters
from workers.cache import WorkerCache, WorkerConfig
from workers.reads.shard import read_shard
from workers.staging.host_config import HostTierConfig


def make_catalog(root: Path, model: str, ranks: list[int]) -> AdapterCatalog:
    for r in ranks:
        if not (root / f"r{r}-000").exists():
            make_adapters(root, SynthConfig(model=model, count=2, rank=str(r), prefix=f"r{r}", seed=r))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model=model, max_rank=max(ranks)))
    catalog.register_dir(root)
    return catalog


def _timed_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def bench_load(catalog: AdapterCatalog, rank: int, tp: int, reps: int) -> dict[str, float]:
    """Median packed-shard load vs median plain pinned copy of the same bytes, interleaved."""
    host = HostTierConfig(host_bytes=3 * 1024**3)
    cache = WorkerCache(WorkerConfig(num_slots=1, tp=tp, tp_rank=0, device="cuda", host=host), catalog)
    name = f"r{rank}-000"
    nbytes = cache.layout_of(name).nbytes
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    cache.prefetch(name).result(timeout=300)  # stages the shard in the host tier
    loads, plain = [], []
    for _ in range(reps):
        assert cache.evict(name)
        loads.append(cache.prefetch(name).result(timeout=60).h2d_ms)
        plain.append(_timed_copy(dst, src, cache.streams.copy_stream))  # type: ignore[attr-defined]
    cache.close()
    load_ms, plain_ms = statistics.median(loads), statistics.median(plain)
    return {"rank": rank, "tp": tp, "shard_mb": nbytes / 1e6, "load_ms": load_ms, "memcpy_ms": plain_ms,
            "load_gbps": nbytes / load_ms / 1e6, "memcpy_gbps": nbytes / plain_ms / 1e6,
            "ratio": plain_ms / load_ms}


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_disk(catalog: AdapterCatalog, rank: int, tp: int, reps: int) -> dict[str, float]:
    """read_shard (only this rank's slices) vs a sequential read of as many bytes of the file."""
    spec = catalog.get(f"r{rank}-000")
    from lora_cache.adapters.shards import shard_layout

    layout = shard_layout(spec, catalog.shape, tp, 0, torch.bfloat16)
    dest = torch.empty(layout.numel, dtype=torch.bfloat16, pin_memory=True)
    raw = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=True)
    out: dict[str, float] = {"rank": rank, "tp": tp, "shard_mb": layout.nbytes / 1e6}
    for mode in ("warm", "cold"):
        shard, seq = [], []
        for _ in range(reps):
            if mode == "cold":
                _drop_cache(spec.weights)
            t0 = time.perf_counter()
            read_shard(spec, layout, dest)
            shard.append(time.perf_counter() - t0)
            if mode == "cold":
                _drop_cache(spec.weights)
            t0 = time.perf_counter()
            with open(spec.weights, "rb", buffering=0) as f:
                f.readinto(raw.numpy())  # type: ignore[attr-defined,arg-type]
            seq.append(time.perf_counter() - t0)
        out[f"{mode}_shard_ms"] = statistics.median(shard) * 1e3
        out[f"{mode}_seq_ms"] = statistics.median(seq) * 1e3
        out[f"{mode}_ratio"] = out[f"{mode}_seq_ms"] / out[f"{mode}_shard_ms"]
    return out


HEAD_START_CYCLES = 50_000_000  # ~25 ms of GPU sleep queued first, so host launch delays cannot show


def _gemm_loop(pairs: list[tuple[torch.Tensor, torch.Tensor]], iters: int, head_start: bool = True) -> float:
    """``iters`` passes over the model's projections (y = x @ W^T) on the compute stream, GPU-timed.

    A GPU sleep is queued before the start event, so the whole loop is enqueued before it starts and
    the figure is the GPU's own time: what loads beside it can change, not Python thread scheduling.
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if head_start:
        torch.cuda._sleep(HEAD_START_CYCLES)
    start.record()
    for _ in range(iters):
        for x, w in pairs:
            torch.matmul(x, w.T)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _raw_copies(nbytes: int, count: int, stream: torch.cuda.Stream) -> list[torch.Tensor]:
    """Enqueue ``count`` plain pinned H2D copies on ``stream`` (no Python threads involved)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(stream):
        for _ in range(count):
            dst.copy_(src, non_blocking=True)
    return [src, dst]


def bench_overlap(catalog: AdapterCatalog, rank: int, iters: int, trials: int) -> dict[str, float]:
    shape, tokens = catalog.shape, 8192
    inputs = {d: torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
              for d in {shape.dims(m)[0] for m in MODULE_ORDER}}
    pairs = [(inputs[shape.dims(m)[0]],
              torch.randn(shape.dims(m)[1], shape.dims(m)[0], device="cuda", dtype=torch.bfloat16) * 0.02)
             for m in MODULE_ORDER]
    host = HostTierConfig(host_bytes=3 * 1024**3)
    cache = WorkerCache(WorkerConfig(num_slots=2, device="cuda", host=host), catalog)
    names = [f"r{rank}-000", f"r{rank}-001"]
    for n in names:
        cache.prefetch(n).result(timeout=300)
    shard = cache.layout_of(names[0]).nbytes
    _gemm_loop(pairs, 3)  # warm-up
    alone, raw, beside, loaded, alone_e2e, beside_e2e = [], [], [], [], [], []
    side = torch.cuda.Stream()
    for _ in range(trials):
        alone.append(_gemm_loop(pairs, iters))
        alone_e2e.append(_gemm_loop(pairs, iters, head_start=False))
        keep = _raw_copies(shard, 24, side)  # ~145 ms of copies queued beside the loop
        raw.append(_gemm_loop(pairs, iters))
        side.synchronize()
        del keep
        stop, started = threading.Event(), threading.Event()

        def churn(stop: threading.Event = stop, started: threading.Event = started) -> None:
            while not stop.is_set():
                for n in names:
                    cache.evict(n)
                    fut = cache.prefetch(n)
                    started.set()
                    fut.result(timeout=60)

        before = cache.counters.loads
        t = threading.Thread(target=churn)
        t.start()
        started.wait()
        beside.append(_gemm_loop(pairs, iters))
        loaded.append(cache.counters.loads - before)
        beside_e2e.append(_gemm_loop(pairs, iters, head_start=False))
        stop.set()
        t.join()
    cache.close()
    a, r, b = statistics.median(alone), statistics.median(raw), statistics.median(beside)
    flops = 2 * tokens * sum(w.numel() for _, w in pairs) * iters
    return {"rank": rank, "shard_mb": shard / 1e6, "gemm_alone_ms": a, "gemm_raw_copies_ms": r,
            "raw_slowdown": r / a, "gemm_with_loads_ms": b, "slowdown": b / a, "tflops_alone": flops / a / 1e9,
            "loads_during_loop": statistics.median(loaded), "trials": trials,
            "e2e_slowdown": statistics.median(beside_e2e) / statistics.median(alone_e2e)}


def table(rows: list[dict[str, float]], cols: list[str]) -> str:
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    return head + "".join("| " + " | ".join(fmt(r[c]) for c in cols) + " |\n" for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--adapters", default=None, help="adapter directory (default: a temporary one)")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--ranks", default="8,16,32,64")
    p.add_argument("--tps", default="1,2")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", default="load,disk,overlap", help="comma-separated parts to run")
    args = p.parse_args()
    ranks, tps = [int(r) for r in args.ranks.split(",")], [int(t) for t in args.tps.split(",")]
    root = Path(args.adapters or tempfile.mkdtemp(prefix="lora-bench-"))
    t0 = time.perf_counter()
    catalog = make_catalog(root, args.model, ranks)
    print(f"made adapters in {time.perf_counter() - t0:.1f} s; device {torch.cuda.get_device_name()}", flush=True)
    parts = set(args.only.split(","))
    load = [bench_load(catalog, r, tp, args.reps) for r in ranks for tp in tps] if "load" in parts else []
    disk = [bench_disk(catalog, r, tp, 5) for r in (ranks[0], ranks[-1]) for tp in tps] if "disk" in parts else []
    overlap = [bench_overlap(catalog, ranks[-1], iters=20, trials=7)] if "overlap" in parts else []
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
               "date": time.strftime("%Y-%m-%d"), "load": load, "disk": disk, "overlap": overlap}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_suite.json").write_text(json.dumps(results, indent=2))
    print("## load: packed shard H2D vs plain pinned memcpy (same bytes, same run)")
    print(table(load, ["rank", "tp", "shard_mb", "load_ms", "memcpy_ms", "load_gbps", "memcpy_gbps", "ratio"]))
    print("## disk -> pinned: shard read (get_slice) vs sequential read of the same bytes")
    print(table(disk, ["rank", "tp", "shard_mb", "warm_shard_ms", "warm_seq_ms", "warm_ratio", "cold_shard_ms",
                       "cold_seq_ms", "cold_ratio"]))
    print("## overlap: bf16 GEMM loop with shard loads beside it vs alone")
    print(table(overlap, ["rank", "shard_mb", "gemm_alone_ms", "gemm_raw_copies_ms", "raw_slowdown",
                          "gemm_with_loads_ms", "slowdown", "e2e_slowdown", "tflops_alone", "loads_during_loop"]))


if __name__ == "__main__":
    main()
