"""Adapters resident per GB of GPU memory: slots of the largest rank against pages of a small one (issue 43).

    python -m bench.probes.pages [--model llama-3.1-8b] [--tp 1] [--slots 8] [--max-rank 64]
        [--mix 16,64] [--mix 8,16,64] [--page-rank 8 --page-rank 16] [--accesses 20000] [--out FILE]

For each rank mix (ranks drawn uniformly, one per adapter of a catalog of 1,000; accesses Zipf 1.0 over it), the
real slot table (``workers.gpu.slots.SlotTable``) is driven through a stream of loads at equal GPU bytes: the
bytes of ``--slots`` shards of ``--max-rank`` (the slots' pool today), or the same bytes in pages of
``--page-rank`` with as many slots (kernel metadata rows) as pages. Each load of an adapter not resident reserves
its run of pages, evicting what the table picks (the least recently used run); no batch holds anything, so what
is measured is the allocator and its fragmentation, not the engine. Reported: adapters resident on average over
the second half of the stream, per GB, the ratio to slots, the hit rate of the accesses, what the catalog's mean
shard would fit (the pool over the mean shard, no page rounding or fragmentation; the resident set leans to small
ranks, so it may hold more) and the share of the pool the resident shards fill. Shard sizes are the worker's own
(``max_shard_numel``, bf16).
Plain CPU; a few seconds.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from lora_cache.adapters.shapes import resolve_model
from lora_cache.adapters.shards import max_shard_numel
from lora_cache.vocab import AdapterKey
from workers.gpu.slots import SlotTable
from workers.kernels.meta import OFFSET_ALIGN

GB = 1e9


def _align(numel: int) -> int:
    return -(-numel // OFFSET_ALIGN) * OFFSET_ALIGN


def resident(ranks: list[int], numel: dict[int, int], page: int, pages: int, slots: int, accesses: int,
             seed: int) -> tuple[float, float, float]:
    """Over the stream's second half: the mean count of adapters resident, the mean share of the pool's elements
    their shards fill (page rounding and free pages are what is left), and the share of accesses that hit."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(ranks))]
    order = list(range(len(ranks)))
    rng.shuffle(order)  # popularity independent of rank
    table = SlotTable(slots, pages)
    held: dict[int, int] = {}
    total = counted = 0
    filled = 0.0
    hits = 0
    for step, i in enumerate(rng.choices(order, weights, k=accesses)):
        key = AdapterKey(f"a{i}", "v")
        slot = held.get(i)
        hits += slot is not None and step >= accesses // 2
        if slot is None:
            index, evicted = table.reserve(key, -(-numel[ranks[i]] // page))
            for gone in evicted:
                del held[int(gone.key.name[1:])]
            table.mark_ready(index)
            held[i] = index
        else:  # a use: most recent in the LRU
            table.incref(slot)
            table.decref(slot)
        if step >= accesses // 2:
            total += len(held)
            filled += sum(numel[ranks[j]] for j in held) / (pages * page)
            counted += 1
    table.check_integrity()
    return total / counted, filled / counted, hits / counted


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--slots", type=int, default=8, help="slots of --max-rank today: the pool's bytes")
    ap.add_argument("--max-rank", type=int, default=64)
    ap.add_argument("--mix", action="append", help="comma-separated ranks, drawn uniformly (repeatable)")
    ap.add_argument("--page-rank", type=int, action="append", help="page sizes to compare (repeatable)")
    ap.add_argument("--catalog", type=int, default=1000)
    ap.add_argument("--accesses", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    shape, dtype = resolve_model(args.model), torch.bfloat16
    mixes = [[int(r) for r in m.split(",")] for m in (args.mix or ["16,64", "8,16,64"])]
    page_ranks = args.page_rank or [8, 16]
    slot = _align(max_shard_numel(shape, args.tp, args.max_rank, dtype))
    pool_bytes = args.slots * slot * dtype.itemsize
    rows = []
    for mix in mixes:
        rng = random.Random(args.seed)
        ranks = [rng.choice(mix) for _ in range(args.catalog)]
        numel = {r: _align(max_shard_numel(shape, args.tp, r, dtype)) for r in mix}
        mean_bytes = sum(numel[r] for r in ranks) / len(ranks) * dtype.itemsize
        base, base_fill, base_hits = resident(ranks, numel, slot, args.slots, args.slots, args.accesses, args.seed)
        row = {"mix": mix, "pool_gb": pool_bytes / GB, "slots": base, "slots_per_gb": base * GB / pool_bytes,
               "slots_filled": base_fill, "slots_hit_rate": base_hits, "catalog_mean_fit": pool_bytes / mean_bytes,
               "paged": {}}
        for page_rank in page_ranks:
            page = _align(max_shard_numel(shape, args.tp, page_rank, dtype))
            pages = args.slots * slot // page
            held, fill, hit = resident(ranks, numel, page, pages, pages, args.accesses, args.seed)
            row["paged"][page_rank] = {"pages": pages, "resident": held, "per_gb": held * GB / pool_bytes,
                                       "vs_slots": held / base, "filled": fill, "hit_rate": hit}
        rows.append(row)
        paged = ", ".join(f"pages of rank {p}: {v['resident']:.1f} ({v['per_gb']:.1f}/GB, {v['vs_slots']:.2f}x slots, "
                          f"{v['filled']:.0%} of the pool filled, hit rate {v['hit_rate']:.1%})"
                          for p, v in row["paged"].items())
        print(f"{args.model} TP {args.tp}, mix {mix}, {pool_bytes / GB:.2f} GB per rank ({args.slots} slots of rank "
              f"{args.max_rank}): slots {base:.1f} resident ({row['slots_per_gb']:.1f}/GB, {base_fill:.0%} of the "
              f"pool filled, hit rate {base_hits:.1%}); {paged}; the catalog's mean shard would fit "
              f"{row['catalog_mean_fit']:.1f}")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "tp": args.tp, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
