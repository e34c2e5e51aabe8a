"""A load's fixed steps on their own (issue 30 item 1, fourth round): what a small shard pays whatever its bytes.

    python -m bench.probes.fixed_costs --model llama-3.1-8b --rank 16 --tp 2 --out results/fixed.json
        [--repeats 300] [--adapters DIR] [--device cpu|cuda]

For one adapter of the shape and rank (made under ``--adapters`` unless there), TP rank 0's shard, medians over
``--repeats``:
- ``meta_write_us``: ``SlotMeta.write`` of a rank pattern written before, into the slot's row and up to the
  device (a host-tier hit's ``issue``; on a GPU the row goes by one non-blocking copy on a stream);
- ``reader_open_ms`` / ``reader_plan_ms`` / ``reader_call_ms``: a reader's steps before and after its tasks
  (``shard.read_slices`` with the tasks and checks left out: the file stat'ed, opened, its header checked, the
  plan and the part's share found, the tasks built, the bytes counted), for one process reading the whole shard
  with ``--readers`` threads, and for part 1 of ``--parts`` (a read split over that many reader processes);
- ``job_pickle_us``: pickling one read's job (what ``ReaderProcess.begin`` sends; a split read pickles it once).
JSON to ``--out``, the figures on stdout. Runs the same from an older tree (``PYTHONPATH``) for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.chunks import chunk_plan
from lora_cache.adapters.files import RACY_NS
from lora_cache.adapters.shapes import MODULE_ORDER
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from workers.kernels import SlotMeta, shard_dims
from workers.reads import shard

NAME = "cold"


def median_us(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class _Pool:
    """Stands in for a ``ReadPool`` of ``size`` threads: the tasks are not run (``run_in_order`` is replaced)."""

    def __init__(self, size: int) -> None:
        self.size = size


def reader_steps(
    spec: Any, layout: Any, plan: Any, part: tuple[int, int], readers: int, repeats: int
) -> dict[str, float]:
    """Median ms of a reader's open, plan and whole call with its tasks and checks not run."""
    dest = torch.empty(layout.numel, dtype=layout.dtype)
    run_in_order = shard.run_in_order
    shard.run_in_order = lambda pool, chunks, done, loops=0: None  # type: ignore[assignment]
    opened, planned, whole = [], [], []
    try:
        for _ in range(repeats):
            marks: list[tuple[str, float]] = []
            t0 = time.perf_counter()
            shard.read_slices(
                spec.source,
                layout.entries,
                dest,
                "probe",
                "sample",
                plan.entry_spans,
                None,
                _Pool(max(1, readers // part[1])),  # type: ignore[arg-type]
                marks=marks,
                part=part,
                readers=readers,
            )
            t1 = time.perf_counter()
            at = {n: t for n, t in marks if not n.startswith("busy")}
            opened.append((at["opened"] - t0) * 1e3)
            planned.append((at["planned"] - at["opened"]) * 1e3)
            whole.append((t1 - t0) * 1e3)
    finally:
        shard.run_in_order = run_in_order
    return {
        "reader_open_ms": statistics.median(opened),
        "reader_plan_ms": statistics.median(planned),
        "reader_call_ms": statistics.median(whole),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--readers", type=int, default=16, help="reader threads of a read (all parts together)")
    ap.add_argument("--parts", type=int, default=4, help="reader processes a split read is spread over")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--adapters", default="", help="where the adapter is made (default: a directory under TMPDIR)")
    ap.add_argument("--out", default="", help="where the JSON goes ('': stdout only)")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    root = Path(args.adapters or Path(os.environ.get("TMPDIR", "/tmp")) / f"lora-cache-cold-{args.model}-r{args.rank}")
    if not (root / NAME).exists():
        make_adapters(root, SynthConfig(model=args.model, count=1, rank=str(args.rank), prefix=NAME, seed=args.rank))
        os.replace(root / f"{NAME}-000", root / NAME)
    weights = root / NAME / "adapter_model.safetensors"  # registered past its racy window, as in service
    time.sleep(max(0.0, (RACY_NS - (time.time_ns() - weights.stat().st_ctime_ns)) / 1e9 + 0.1))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model=args.model, max_rank=args.rank))
    spec = catalog.register(NAME, root / NAME)
    shape = catalog.shape
    layout = shard_layout(spec, shape, args.tp, 0, torch.bfloat16)
    plan = chunk_plan(layout.entries, layout.numel, shape.num_layers, 2)
    device = torch.device(args.device)
    meta = SlotMeta(2, shape.num_layers, MODULE_ORDER, device, max_rank=args.rank, dims=shard_dims(shape, args.tp))
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    meta.write(0, layout, None, stream)
    slots = iter(range(10**9))
    out: dict[str, Any] = {
        "model": args.model,
        "rank": args.rank,
        "tp": args.tp,
        "device": str(device),
        "shard_bytes": layout.nbytes,
        "chunks": len(plan.chunks),
        "modules": len(layout.modules),
        "meta_write_us": median_us(args.repeats, lambda: meta.write(next(slots) % 2, layout, None, stream)),
        "job_pickle_us": median_us(
            args.repeats,
            lambda: pickle.dumps(
                (
                    spec.source,
                    "sample",
                    id(layout.entries),
                    "TP 0/2",
                    "bfloat16",
                    layout.numel,
                    0,
                    [(c.start, c.stop) for c in plan.entry_spans],
                    (1, args.parts),
                    args.readers,
                )
            ),
        ),
        "one_process": reader_steps(spec, layout, plan, (0, 1), args.readers, args.repeats),
        f"part_1_of_{args.parts}": reader_steps(spec, layout, plan, (1, args.parts), args.readers, args.repeats),
    }
    if stream is not None:
        stream.synchronize()
    text = json.dumps(out, indent=2)
    print(text, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return out


if __name__ == "__main__":
    main()
