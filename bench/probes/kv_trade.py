"""The engine trading adapter pages against KV rows as its batch grows (issue 43 item 3), at equal GPU bytes.

    python -m bench.probes.kv_trade [--device cuda] [--model llama-3.1-8b] [--layers 0] [--adapters 48]
        [--rank 16] [--max-running 32] [--own-rows 8] [--pages 12] [--max-adapters 8] [--max-seq-len 1024]
        [--quiet-s 20] [--quiet-rate 2] [--burst-s 5] [--burst-rate 24] [--out FILE]

Two reference engines (``run_engine``, one rank) serve the same requests with the same GPU bytes for KV rows and
adapter pages together:
- ``fixed``: ``max_running`` KV rows of its own and a pool of ``--pages`` pages of rank ``--rank``;
- ``breathing``: the fixed engine's KV bytes added to its pool as pages (``EngineConfig.kv_rows``): it keeps
  ``--own-rows`` rows (and the padding row) there from the start, the rest hold adapters until its batch borrows
  them back as it grows (``workers/engine/kv_rows.py``).
The requests: Zipf 1.5 over ``--adapters`` adapters of rank ``--rank`` (one page each), a quiet phase, a burst,
then quiet again. Reported per engine: mean / p99 TTFT per phase, GPU hit rate, loads, the largest batch, rows
borrowed and the host time of a row's give-back. CPU (tiny shapes) or one GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from lora_cache.adapters.shapes import resolve_model
from lora_cache.adapters.synth import SynthConfig, make_adapters
from workers.cache import WorkerConfig, pool_pages
from workers.engine import EngineConfig, EngineResult, Request, run_engine
from workers.engine.kv_rows import row_pages
from workers.staging.host_config import HostTierConfig


def phases(args: argparse.Namespace, names: list[str]) -> list[Request]:
    """Quiet, burst, quiet: Poisson arrivals at each phase's rate, Zipf 1.5 adapters, fixed lengths."""
    rng = random.Random(args.seed)
    weights = [1 / (i + 1) ** 1.5 for i in range(len(names))]
    out: list[Request] = []
    t, start = 0.0, 0.0
    for length, rate in ((args.quiet_s, args.quiet_rate), (args.burst_s, args.burst_rate),
                         (args.quiet_s, args.quiet_rate)):
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + length:
                break
            out.append(Request(len(out), rng.choices(names, weights)[0], args.input_len, args.output_len, t))
        start += length
    return out


def phase_of(args: argparse.Namespace, t: float) -> str:
    return "quiet" if t < args.quiet_s or t >= args.quiet_s + args.burst_s else "burst"


def report(args: argparse.Namespace, result: EngineResult) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in ("quiet", "burst"):
        ttft = sorted(r.ttft_s * 1e3 for r in result.records if r.ok and phase_of(args, r.arrival_s) == phase)
        out[phase] = {"requests": len(ttft), "mean_ttft_ms": statistics.fmean(ttft) if ttft else None,
                      "p99_ttft_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None}
    ends: dict[float, int] = {}
    for r in result.records:
        for t in r.token_s:
            ends[t] = ends.get(t, 0) + 1
    cache = result.ranks[0].cache
    hits, misses = int(cache["gpu_hits"]), int(cache["gpu_misses"])
    summary = result.summary()
    out |= {"mean_ttft_ms": summary["mean_ttft_ms"], "p99_ttft_ms": summary["p99_ttft_ms"],
            "failed": summary["failed"], "gpu_hit": hits / max(1, hits + misses), "loads": cache["loads"],
            "largest_batch": max(ends.values()), "kv": result.ranks[0].kv}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=0, help="layers run (0: all)")
    ap.add_argument("--adapters", type=int, default=48)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--own-rows", type=int, default=8)
    ap.add_argument("--pages", type=int, default=12, help="the fixed engine's pool pages")
    ap.add_argument("--max-adapters", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--quiet-s", type=float, default=20.0)
    ap.add_argument("--quiet-rate", type=float, default=2.0)
    ap.add_argument("--burst-s", type=float, default=5.0)
    ap.add_argument("--burst-rate", type=float, default=24.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    shape = resolve_model(args.model)
    layers = args.layers or shape.num_layers
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    page_numel, _ = pool_pages(WorkerConfig(num_slots=1, page_rank=args.rank, pool_pages=1), shape, args.rank, dtype)
    _, per_row = row_pages((shape.num_kv_heads, args.max_seq_len, shape.head_dim), layers, page_numel)
    extra = (args.max_running + 1) * per_row  # every row of the fixed engine's KV cache (and its padding row)
    common: dict[str, Any] = dict(model=args.model, num_layers=args.layers, device=args.device,
                                  max_running=args.max_running, max_adapters=args.max_adapters, max_rank=args.rank,
                                  page_rank=args.rank, max_seq_len=args.max_seq_len,
                                  max_prefill_tokens=max(args.input_len * 8, 1024), admission="overlap",
                                  host=HostTierConfig(host_bytes=4 << 30 if args.device == "cuda" else 256 << 20))
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                           "args": {k: str(v) for k, v in vars(args).items()}, "page_bytes": page_numel *
                           dtype.itemsize, "row_pages": per_row, "extra_pages": extra}
    with tempfile.TemporaryDirectory() as root:
        make_adapters(Path(root), SynthConfig(model=args.model, count=args.adapters, rank=str(args.rank)))
        names = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        requests = phases(args, names)
        out["requests"] = len(requests)
        for name, kw in (("fixed", dict(pool_pages=args.pages, num_slots=args.pages)),
                         ("breathing", dict(pool_pages=args.pages + extra, num_slots=args.pages + extra,
                                            kv_rows=args.own_rows))):
            config = EngineConfig(adapters=root, **common, **kw)
            out[name] = report(args, run_engine(config, requests))
            print(name, json.dumps(out[name]), flush=True)
    text = json.dumps(out, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)
    return out


if __name__ == "__main__":
    main()
