"""Cold shard loads at the limit (issue 30): page cache -> pinned -> GPU per TP rank, against references
measured in the same run on the same host.

    python -m bench.probes.cold_read --model llama-3.1-8b --rank 64 --tp 4 --out results/cold.json
        [--readers 1,auto] [--repeats 5] [--ref-threads 1,4,8,16] [--mechanisms 1,8] [--adapters DIR]
    python -m bench.probes.cold_read --model tiny --rank 16 --tp 2 --cpu --out /tmp/cold.json   # anywhere, seconds

One adapter of the shape and rank, read by ``--tp`` ranks: processes with one GPU each, or threads on the CPU
(``--cpu``, or no GPU; ``--ranks-in`` chooses). For each reader count of ``--readers`` (1: the single reader
before issue 30; auto: the default, ``HostTierConfig.read_parallel`` 0) every rank builds a ``WorkerCache``
and the run measures:

(a) ``read``: the reference, a parallel sequential read of as many bytes of the same file as a shard holds,
    ``T`` threads of 8 MiB ``preadv`` into pinned memory (page cache warm), each rank alone and all at once,
    for each ``T`` of ``--ref-threads``; the figures below use ``T`` = the auto reader count;
(b) ``memcpy``: a plain pinned host -> GPU copy of a shard's bytes, each GPU alone and all at once (on the
    CPU a pinned -> pageable copy stands in);
(c) ``cold``: a load through the real path (``prefetch`` -> READY: host-tier miss, reader, chunked copies),
    the file in the page cache (read once first), the shard dropped from the host tier before each; each
    rank alone and all ranks at once;
(d) ``hit``: the same load as a host-tier hit (the copy alone), all ranks at once;
(e) ``ready``: prefetch -> replica ready (the last rank's READY) of the all-at-once cold loads.

Figures, named as the issue names them (medians over ``--repeats``):
- ``load_over_read``: per rank, page-cache -> GPU GB/s alone over the reference's, alone (goal >= 0.8);
- ``cold_over_memcpy``: the ranks' cold loads at once, their bytes over first start to last READY, over the
  aggregate memcpy, the same bytes all at once (goal >= 0.5 at TP 4);
- ``hit_over_memcpy``: the same for host-tier hits (goal >= 0.9);
- ``ready_over_bound``: prefetch -> replica ready over (read + copy) of the largest shard, the references
  taken all at once (goal <= 1.3).
``--mechanisms``: rank 0 alone reads its shard outside the cache with each mechanism (the single reader;
``preadv``, the default, positioned reads straight into the buffer, a column slice over its span; ``rows``, a
column slice row by row; ``mmap``, the single reader's mapped-file copies split over threads; ``identity``, no
block checked) at each thread count given. JSON to ``--out``, a table on stdout.

Beside it: ``load_phases.py`` splits a load's marks into the phases above, ``cold_report.py`` writes the table
and ``--summary``, ``arena_pin.py`` is ``--arena-pin``'s measurement.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.probes.arena_pin import arena_pin
from bench.probes.cold_report import summary, table
from bench.probes.load_phases import median_phases
from bench.probes.load_phases import phases as phases  # re-exported: the table names bench.probes.cold_read.phases
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.chunks import chunk_plan
from lora_cache.adapters.files import RACY_NS
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.vocab import AdapterKey
from workers.cache import WorkerCache, WorkerConfig
from workers.reads.shard import read_shard, read_slices
from workers.reads.threads import ReadPool, auto_readers, host_cores, ranks_on_host
from workers.staging.host_config import HostTierConfig

PIECE = 8 << 20  # the reference's reads
NAME = "cold"


def parallel_pieces(nbytes: int, threads: int, work: Callable[[int, int], int]) -> int:
    """``work(offset, length)`` over ``nbytes`` in ``PIECE``-byte pieces, ``threads`` threads taking every
    ``threads``-th piece; the sum of what ``work`` returned. A thread's error is raised here, once all joined."""
    offsets = list(range(0, nbytes, PIECE))
    done, errors = [0] * threads, []

    def run(i: int) -> None:
        try:
            for off in offsets[i::threads]:
                done[i] += work(off, min(PIECE, nbytes - off))
        except Exception as e:  # raised by the caller's thread
            errors.append(e)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    return sum(done)


def parallel_read(fd: int, raw: memoryview, nbytes: int, threads: int) -> int:
    """The reference: ``nbytes`` of the file from its start, ``threads`` threads of ``PIECE``-byte preadv; the bytes
    read (fewer past the file's end)."""
    return parallel_pieces(nbytes, threads, lambda off, n: os.preadv(fd, [raw[off : off + n]], off))


class Rank:
    """One TP rank: its catalog, buffers and (for each reader count) its worker cache."""

    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.rank, self.cfg = rank, cfg
        self.gpu = not cfg["cpu"]
        self.device = f"cuda:{rank}" if self.gpu else "cpu"
        if self.gpu:
            torch.cuda.set_device(rank)
        self.catalog = AdapterCatalog(CatalogConfig(adapter_roots=(cfg["root"],), model=cfg["model"],
                                                    max_rank=cfg["rank"]))
        self.spec = self.catalog.register(NAME, Path(cfg["root"]) / NAME)
        self.dtype = torch.bfloat16
        self.layout = shard_layout(self.spec, self.catalog.shape, cfg["tp"], rank, self.dtype)
        self.nbytes = self.layout.nbytes
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.gpu)
        self.raw = memoryview(self.host.numpy())  # type: ignore[arg-type]
        self.target = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if self.gpu else None
        self.cache: WorkerCache | None = None
        self.key = AdapterKey(NAME, self.spec.version)

    def build(self, readers: int, reads: str = "auto", verify: str = "sample", split: int = 0) -> dict[str, Any]:
        """A fresh worker cache with ``readers`` reader threads per read (0: auto), reads where ``reads`` says
        (``HostTierConfig.reads``), checked as ``verify`` says, warmed by one load."""
        self.close()
        # inclusive tiers: the probe times reads and copies, and drops the host copy itself between them (an
        # exclusive tier's write-back at each eviction would put a device-to-host copy between every two timings)
        host = HostTierConfig(host_bytes=self.nbytes + (4 << 20), read_parallel=readers, pin=self.gpu, reads=reads,
                              verify=verify, read_split=split, read_threads=max(4, split), tiers="inclusive")
        self.cache = WorkerCache(WorkerConfig(num_slots=1, tp=self.cfg["tp"], tp_rank=self.rank, dtype="bfloat16",
                                              device=self.device, host=host), self.catalog)
        self.cache.prefetch(NAME).result(timeout=600)  # reader processes started, the path warm
        self._forget(host_too=True)
        return {"readers": self.cache.host.parallel, "reads": self.cache.host.reads, "nbytes": self.nbytes,
                "verify": verify, "split": self.cache.host.split}

    def _forget(self, host_too: bool) -> None:
        assert self.cache is not None
        assert self.cache.evict(NAME), "the adapter was not READY and idle"
        if host_too:
            assert self.cache.host.drop(self.key), "the shard was still referenced in the host tier"

    def load(self, hit: bool) -> dict[str, Any]:
        """One prefetch -> READY: a host-tier hit, or a cold read (the shard dropped from the tier first)."""
        assert self.cache is not None
        if hit and not self.cache.host.contains(self.key):
            self.cache.prefetch(NAME).result(timeout=600)
            self._forget(host_too=False)
        t0 = time.perf_counter()
        record = self.cache.prefetch(NAME).result(timeout=600)
        t1 = time.perf_counter()
        assert record.host_hit == hit, record
        load = self.cache.book.loads[record.slot]
        split = phases(load.t0, load.marks, [] if hit else load.entry.marks)
        self._forget(host_too=not hit)
        return {"t0": t0, "t1": t1, "ms": (t1 - t0) * 1e3, "disk_ms": record.disk_ms, "h2d_ms": record.h2d_ms,
                "ready_ms": record.ready_ms, "phases": split}

    def read_ref(self, threads: int) -> dict[str, Any]:
        fd = os.open(str(self.spec.weights), os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            parallel_read(fd, self.raw, self.nbytes, threads)
            t1 = time.perf_counter()
        finally:
            os.close(fd)
        return {"t0": t0, "t1": t1, "ms": (t1 - t0) * 1e3}

    def memcpy(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.target.copy_(self.host, non_blocking=True)
            self.stream.synchronize()
        else:
            self.target.copy_(self.host)
        t1 = time.perf_counter()
        return {"t0": t0, "t1": t1, "ms": (t1 - t0) * 1e3}

    def mechanisms(self, counts: list[int]) -> dict[str, Any]:
        """Rank 0's shard read outside the cache by each mechanism, median ms of the repeats."""
        plan = chunk_plan(self.layout.entries, self.layout.numel, self.catalog.shape.num_layers, 2)
        dest = self.host[: self.nbytes].view(self.dtype)
        assert self.spec.source is not None
        ways: dict[str, Any] = {"single (mmap copy)": lambda: read_shard(self.spec, self.layout, dest, "sample",
                                                                         plan.entry_spans)}
        pools = {n: ReadPool(n) for n in counts}
        for n, pool in pools.items():
            ways[f"preadv x{n}"] = lambda p=pool: read_shard(self.spec, self.layout, dest, "sample", plan.entry_spans,
                                                             None, p)
            for how in ("rows", "mmap"):
                ways[f"{how} x{n}"] = lambda p=pool, h=how: read_slices(
                    self.spec.source, self.layout.entries, dest, "", "sample", plan.entry_spans, None, p, h)
            ways[f"preadv x{n}, identity"] = lambda p=pool: read_shard(self.spec, self.layout, dest, "identity",
                                                                       plan.entry_spans, None, p)
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(self.cfg["repeats"]):
            for k, way in ways.items():
                t0 = time.perf_counter()
                way()
                times[k].append((time.perf_counter() - t0) * 1e3)
        for pool in pools.values():
            pool.close()
        return {k: statistics.median(v) for k, v in times.items()}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None


def rank_main(rank: int, cfg: dict[str, Any], commands: Any, results: Any, barrier: Any) -> None:
    """A rank's command loop: (op, arg, together) in, (rank, result) out; ``together`` waits on the barrier."""
    try:
        r = Rank(rank, cfg)
    except BaseException as e:
        results.put((rank, {"error": f"{type(e).__name__}: {e}"}))
        return
    results.put((rank, {"nbytes": r.nbytes}))
    ops: dict[str, Callable[..., dict[str, Any]]] = {"build": r.build, "load": r.load, "read": r.read_ref,
                                                     "memcpy": r.memcpy, "mechanisms": r.mechanisms}
    while (command := commands.get()) is not None:
        op, arg, together = command
        try:
            if together:
                barrier.wait(timeout=600)
            results.put((rank, ops[op](*arg)))
        except BaseException as e:
            results.put((rank, {"error": f"{op}: {type(e).__name__}: {e}"}))
    r.close()


class Ranks:
    """The ranks' command queues, in processes (one GPU each) or threads."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        tp = cfg["tp"]
        if cfg["ranks_in"] == "thread":
            self.results: Any = queue.Queue()
            self.commands: list[Any] = [queue.Queue() for _ in range(tp)]
            barrier: Any = threading.Barrier(tp)
            self.workers: list[Any] = [threading.Thread(target=rank_main, daemon=True,
                                                        args=(k, cfg, self.commands[k], self.results, barrier))
                                       for k in range(tp)]
        else:
            ctx = mp.get_context("spawn")
            self.results = ctx.Queue()
            self.commands = [ctx.Queue() for _ in range(tp)]
            barrier = ctx.Barrier(tp)
            self.workers = [ctx.Process(target=rank_main, args=(k, cfg, self.commands[k], self.results, barrier))
                            for k in range(tp)]
        for w in self.workers:
            w.start()
        self.nbytes = [x["nbytes"] for x in self._gather(range(tp))]

    def _gather(self, ranks: range | list[int]) -> list[dict[str, Any]]:
        got: dict[int, dict[str, Any]] = {}
        while len(got) < len(ranks):
            rank, result = self.results.get(timeout=900)
            if "error" in result:
                raise RuntimeError(f"rank {rank}: {result['error']}")
            got[rank] = result
        return [got[k] for k in ranks]

    def one(self, rank: int, op: str, *arg: Any) -> dict[str, Any]:
        self.commands[rank].put((op, arg, False))
        return self._gather([rank])[0]

    def all(self, op: str, *arg: Any) -> list[dict[str, Any]]:
        for q in self.commands:
            q.put((op, arg, True))
        return self._gather(range(len(self.commands)))

    def stop(self) -> None:
        for q in self.commands:
            q.put(None)
        for w in self.workers:
            w.join(timeout=120)


def span_ms(results: list[dict[str, Any]]) -> float:
    """First start to last end of operations run at once."""
    return (max(r["t1"] for r in results) - min(r["t0"] for r in results)) * 1e3


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def alone_and_together(ranks: Ranks, repeats: int, op: str, *arg: Any) -> dict[str, Any]:
    """Median ms of ``op`` on each rank alone, and of all ranks at once (first start to last end)."""
    tp = len(ranks.commands)
    raw = [[ranks.one(k, op, *arg) for _ in range(repeats)] for k in range(tp)]
    alone = [med([r["ms"] for r in rs]) for rs in raw]
    together = [ranks.all(op, *arg) for _ in range(repeats)]
    return {"alone_ms": alone, "together_ms": med([span_ms(t) for t in together]), "together": together,
            "alone": [r for rs in raw for r in rs]}


def measure(ranks: Ranks, cfg: dict[str, Any], readers: list[int], ref_threads: list[int], ref_main: int,
            mechanisms: list[int], variants: Sequence[tuple[str, int, int, str]] = ()) -> dict[str, Any]:
    """``variants``: (reads, readers, split, verify) of each cache measured (0: auto); default: ``readers`` with
    the default reads, split and verify."""
    reps, nbytes = cfg["repeats"], ranks.nbytes
    total, largest = sum(nbytes), max(nbytes)
    memcpy = alone_and_together(ranks, reps, "memcpy")
    refs = {t: alone_and_together(ranks, reps, "read", t) for t in ref_threads}
    ref = refs[ref_main]
    rows = []
    for how, n, split, verify in variants or [("auto", n, 0, "sample") for n in readers]:
        built = ranks.all("build", n, how, verify, split)
        cold = alone_and_together(ranks, reps, "load", False)
        hits = [ranks.all("load", True) for _ in range(reps)]
        per_rank = [b / ms / 1e6 for b, ms in zip(nbytes, cold["alone_ms"], strict=True)]
        ref_rank = [b / ms / 1e6 for b, ms in zip(nbytes, ref["alone_ms"], strict=True)]
        bound = ref["together_ms"] + memcpy["together_ms"]
        rows.append({
            "readers": built[0]["readers"], "asked": n, "reads": built[0]["reads"], "verify": verify,
            "split": built[0]["split"],
            "phases_cold_alone": median_phases(cold["alone"]),
            "phases_cold_together": median_phases([r for t in cold["together"] for r in t]),
            "phases_hit_together": median_phases([r for h in hits for r in h]),
            "cold_alone_ms": cold["alone_ms"], "cold_together_ms": cold["together_ms"],
            "hit_together_ms": med([span_ms(h) for h in hits]),
            "cold_disk_ms": med([r["disk_ms"] for t in cold["together"] for r in t]),
            "cold_h2d_ms": med([r["h2d_ms"] for t in cold["together"] for r in t]),
            "per_rank_GBps": per_rank, "ref_per_rank_GBps": ref_rank,
            "load_over_read": med([a / b for a, b in zip(per_rank, ref_rank, strict=True)]),
            "load_over_best_read": med(per_rank) / max(med([b / ms / 1e6 for b, ms in zip(nbytes, r["alone_ms"],
                                                                                            strict=True)])
                                                       for r in refs.values()),
            "cold_GBps": total / cold["together_ms"] / 1e6,
            "memcpy_GBps": total / memcpy["together_ms"] / 1e6,
            "cold_over_memcpy": memcpy["together_ms"] / cold["together_ms"],
            "hit_over_memcpy": memcpy["together_ms"] / med([span_ms(h) for h in hits]),
            "ready_ms": cold["together_ms"], "bound_ms": bound, "ready_over_bound": cold["together_ms"] / bound,
        })
    out: dict[str, Any] = {
        "shard_bytes": nbytes, "largest_shard_bytes": largest, "ref_threads": ref_main,
        "memcpy_alone_ms": memcpy["alone_ms"], "memcpy_together_ms": memcpy["together_ms"],
        "memcpy_alone_GBps": [b / ms / 1e6 for b, ms in zip(nbytes, memcpy["alone_ms"], strict=True)],
        "memcpy_together_GBps": total / memcpy["together_ms"] / 1e6,
        "read": {t: {"alone_ms": r["alone_ms"], "together_ms": r["together_ms"],
                     "alone_GBps": med([b / ms / 1e6 for b, ms in zip(nbytes, r["alone_ms"], strict=True)]),
                     "together_GBps": total / r["together_ms"] / 1e6} for t, r in refs.items()},
        "rows": rows,
    }
    if mechanisms:
        out["mechanisms_ms"] = ranks.one(0, "mechanisms", mechanisms)
        out["mechanisms_GBps"] = {k: nbytes[0] / v / 1e6 for k, v in out["mechanisms_ms"].items()}
    return out


def variants(text: str) -> list[tuple[str, int, int, str]]:
    """``--variants``: (reads, readers, split, verify) each."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        reads, readers, split, verify = item.split(":")
        out.append((reads, int(readers), int(split), verify))
    return out


def counts(text: str, auto: int) -> list[int]:
    return [auto if x.strip() == "auto" else int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--readers", default="1,auto", help="reader threads per read to measure (auto: the default)")
    ap.add_argument("--ref-threads", default="auto", help="the reference's thread counts (auto: the default readers)")
    ap.add_argument("--mechanisms", default="", help="thread counts for rank 0's mechanism comparison ('' : none)")
    ap.add_argument("--variants", default="", help="caches to measure instead of --readers, comma-separated "
                    "READS:READERS:SPLIT:VERIFY each (HostTierConfig reads auto/process/thread, read_parallel, "
                    "read_split, verify; 0: auto), e.g. process:0:0:sample,process:8:1:sample,thread:0:1:identity")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--adapters", default="", help="where the adapter is made (default: a directory under TMPDIR)")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks (the default without a GPU)")
    ap.add_argument("--ranks-in", choices=("process", "thread"), default=None,
                    help="a process per rank (the default with GPUs) or a thread per rank (the default on the CPU)")
    ap.add_argument("--out", help="where the JSON goes (required unless --summary)")
    ap.add_argument("--arena-pin", type=float, default=0, metavar="GIB",
                    help="only time pinning a GIB shared host arena (issue 30 item 3): in place, and in the "
                         "background with GPU work (small copies and matmuls, a warm-up's kind) timed meanwhile")
    ap.add_argument("--summary", metavar="DIR", help="only summarize DIR's cold-*.json (the goals per shape and "
                                                     "row, the phases of cold loads and hits) into DIR/summary.md")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.summary:
        text = summary(Path(args.summary))
        (Path(args.summary) / "summary.md").write_text(text)
        print(text, flush=True)
        return {"summary": text}
    if not args.out:
        raise SystemExit("--out is required (or --summary DIR)")
    if args.arena_pin:
        out = arena_pin(int(args.arena_pin * (1 << 30)))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(json.dumps(out, indent=2), flush=True)
        return out
    cpu = args.cpu or not torch.cuda.is_available()
    if not cpu and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs, this host has {torch.cuda.device_count()}; "
                         "lower --tp or pass --cpu")
    root = Path(args.adapters or Path(tempfile.gettempdir()) / f"lora-cache-cold-{args.model}-r{args.rank}")
    if not (root / NAME).exists():
        make_adapters(root, SynthConfig(model=args.model, count=1, rank=str(args.rank), prefix=NAME, seed=args.rank))
        os.replace(root / f"{NAME}-000", root / NAME)
    weights = root / NAME / "adapter_model.safetensors"
    with open(weights, "rb", buffering=0) as f:  # the page cache warm: every load below is a page-cache read
        while f.read(64 << 20):
            pass
    # a file changed within RACY_NS of its registration is checked in full on every read until a check after
    # the window (lora_cache.adapters.files): registered later than that, the reads check as they will in service
    time.sleep(max(0.0, (RACY_NS - (time.time_ns() - weights.stat().st_ctime_ns)) / 1e9 + 0.1))
    auto = auto_readers(host_cores(), ranks_on_host(args.tp))  # as each rank's cache resolves read_parallel 0
    cfg = {"cpu": cpu, "root": str(root), "model": args.model, "rank": args.rank, "tp": args.tp,
           "repeats": args.repeats, "ranks_in": args.ranks_in or ("thread" if cpu else "process")}
    ref_threads = sorted(set(counts(args.ref_threads, auto)) | {auto})
    ranks = Ranks(cfg)
    try:
        out = measure(ranks, cfg, [0 if x.strip() == "auto" else int(x) for x in args.readers.split(",")],
                      ref_threads, auto, counts(args.mechanisms, auto), variants(args.variants))
    finally:
        ranks.stop()
    out.update(model=args.model, rank=args.rank, tp=args.tp, cpu=cpu, ranks_in=cfg["ranks_in"],
               file_bytes=weights.stat().st_size,
               device=torch.cuda.get_device_name(0) if not cpu else platform.processor() or "cpu",
               gpus=torch.cuda.device_count() if not cpu else 0, cores=host_cores(), auto_readers=auto,
               host=platform.node(), date=time.strftime("%Y-%m-%d %H:%M"),
               command=" ".join(["python -m bench.probes.cold_read", *(sys.argv[1:] if argv is None else argv)]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(table(out), flush=True)
    return out


if __name__ == "__main__":
    main()
