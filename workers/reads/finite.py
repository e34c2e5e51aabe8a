"""Weights proven finite before a chunk is published (lifecycle step 5).

A NaN or Inf in an adapter's weights turns every request that uses the adapter into NaNs, so a chunk that holds one
is never published (``workers.staging.host_tier``: ``HostEntry.progress``), never copied to a GPU, and its load
fails before READY. The check runs on the host copy, laid out as the slot (after any dtype conversion: a float32
weight beyond float16's range is Inf there and refused too), once per chunk, on bytes already in memory.

Fast path: sums of rows of ``ROW`` elements over the chunk's span, no temporary of its size. NaN and Inf propagate
through any sum, so finite sums prove every element finite; rows rather than one sum so that a float16 chunk's
total does not overflow to Inf. Only a non-finite sum (a bad weight, a row sum that overflowed, or padding between
entries left from an earlier shard) looks at each entry with ``torch.isfinite`` to name the tensor; one that finds
none passes. Measured on a 64 MiB bfloat16 tensor on one CPU thread: ~9 ms for the sums (~7 GB/s), ~250 ms for
``torch.isfinite(t).all()`` (a bool temporary of 32 Mi elements).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from lora_cache.adapters.shards import ShardEntry, ShardLayout
from lora_cache.errors import NonFiniteWeightsError

ROW = 4096  # elements per partial sum: a float16 row overflows only if its mean |weight| is above 16


PIECE_BYTES = 8 << 20  # a span above twice this is proven in pieces of about this size, on CHECK_THREADS threads
CHECK_THREADS = max(1, min(8, os.cpu_count() or 1))  # one thread alone runs at a one-thread memcpy's rate
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def all_finite(t: torch.Tensor) -> bool:
    """Whether the 1-D ``t`` has no NaN or Inf. Where torch runs fewer intra-op threads than ``CHECK_THREADS`` (a
    worker actor's runs one), a large ``t`` is proven in pieces on a small pool (torch's sums release the GIL):
    one thread checks at about a one-thread memcpy's rate, below a parallel read's. On an H200 host's 16 cores,
    168 MiB of bf16 at one torch thread: 7.7 GB/s on one thread, 30.8 GB/s on the pool of 8; with 16 torch
    threads torch's own sum, 102 GB/s (``bench/probes/finite_check.py``)."""
    piece = max(ROW, PIECE_BYTES // max(1, t.element_size()) // ROW * ROW)
    if t.numel() <= 2 * piece or torch.get_num_threads() >= CHECK_THREADS:  # torch's own threads do it better
        return one_finite(t)
    return all(_pool().map(one_finite, [t[i : i + piece] for i in range(0, t.numel(), piece)]))


def one_finite(t: torch.Tensor) -> bool:
    """``all_finite`` on this thread: partial sums of ``ROW`` elements (``isfinite`` only if one is not finite)."""
    return bool(sums_finite(t)) or bool(torch.isfinite(t).all())


def sums_finite(t: torch.Tensor) -> torch.Tensor:
    """A bool tensor on ``t``'s device: every partial sum of ``ROW`` elements of the 1-D ``t`` is finite. True
    proves ``t`` finite (NaN and Inf survive any sum); False may be a float16 row that overflowed, so only then is
    ``t`` looked at element by element. No host sync and no temporary of ``t``'s size."""
    n = t.numel() - t.numel() % ROW
    return torch.isfinite(t[:n].view(-1, ROW).sum(1)).all() & torch.isfinite(t[n:].sum())


def total_finite(t: torch.Tensor) -> torch.Tensor:
    """A bool tensor on ``t``'s device: the float32 sum of ``t`` is finite, which proves ``t`` finite (NaN and Inf
    survive any sum). Two launches, against ``sums_finite``'s six: for a device fill (``workers.reads.device``), where
    each launch costs the launching thread ~20 us (measured on one H100 for an 8B rank-16 shard: 140 us for
    ``sums_finite``, bench/reports/issue-44.md). False may also be a float32 total past 3.4e38 (bfloat16 and float32
    weights that large), so only then is ``t`` looked at element by element (``check_finite``), as for a row sum."""
    return torch.isfinite(t.sum(dtype=torch.float32))


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="lora-cache-finite")
        return _POOL


def check_finite(name: str, layout: ShardLayout, dest: torch.Tensor, entries: Sequence[ShardEntry]) -> None:
    """NonFiniteWeightsError naming the first of ``entries`` (a chunk's, in ``dest``, a 1-D buffer in
    ``layout``'s packing) that holds a NaN or Inf; ``name``: the adapter (``name@version``)."""
    if not entries or all_finite(dest[entries[0].offset : entries[-1].offset + entries[-1].numel]):
        return  # the span's padding between entries is summed too: a non-finite sum there is looked at below
    for e in entries:
        part = dest[e.offset : e.offset + e.numel]
        if not all_finite(part):
            raise NonFiniteWeightsError(_message(name, layout, e, part))


def _message(name: str, layout: ShardLayout, e: ShardEntry, part: torch.Tensor) -> str:
    nan, inf = int(torch.isnan(part).sum()), int(torch.isinf(part).sum())
    first = int((~torch.isfinite(part)).nonzero()[0, 0])
    row, col = divmod(first, e.shape[1])
    dtype = str(layout.dtype).removeprefix("torch.")
    return (f"adapter {name}: tensor {e.key} (layer {e.layer} {e.module}.lora_{e.ab}, TP {layout.rank}/{layout.tp} "
            f"slice {list(e.shape)} as {dtype}) holds {nan} NaN and {inf} Inf values (the first at [{row}, {col}] of "
            f"the slice): every request using it would compute NaNs, so its load is refused and it is not served. "
            f"Re-export the adapter with finite weights (a diverged training run, or float32 values beyond "
            f"{dtype}'s range) and register it again")
