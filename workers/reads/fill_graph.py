"""A pushed image's fill as one CUDA graph (lifecycle step 5, the device source of a push; issue 44 item 5).

A rank's fill from a trainer's image (``workers.reads.device.read_image``) is a few launches: the gather, the finite
proof's sum and test. On one H100 their host time is ~0.15 ms alone, hot, and ~0.4-0.6 ms inside a load, the most of
an 8B rank-16 push's rank-side part (bench/reports/issue-44.md, "the rank's own part"), while the GPU does ~0.05 ms of
work. A trainer pushes every version of an adapter from the same buffer with the same header, and a rank's new
versions take the few slots its older ones leave, so the same launches run on the same addresses again and again:
captured once into a graph per (buffer, plan, slot), each later fill into that slot is one graph launch, gathering
straight into the slot.

- ``FillGraphs``: a rank's graphs, one per (image address, image size, read plan, slot address, shard size), the last
  ``keep``; a shard over ``max_bytes`` (the 70B's, whose fill is GPU time, not launches), a plan with dtype
  conversions, or a capture the GPU has no room for (remembered) gets none and is filled by ``read_image``, as before.
  It also keeps the loads' pinned finite flags for reuse (``flag``/``give``): a pinned allocation costs a load
  ~0.05-0.1 ms.
- Keyed by every address its kernels took, a graph writes only where its key says: into the slot it was captured for,
  whatever version is loading there now, never into another (a slot's address is the pool's, fixed while the rank
  runs; a pool made anew at other addresses makes new keys).
- The graph reads the image's bytes when it runs, not when it was captured: a new version in the same buffer is
  gathered anew (the GPU tests push three contents and a NaN through one buffer into slots reused).
- Replays of one graph are serialized under its lock (its finite flag on the device is its own): the replay and the
  flag's copy into the load's own pinned flag are issued on the caller's stream (the rank's copy stream).
- Captured with ``CUDAGraph.capture_begin`` / ``capture_end`` on a side stream, ``thread_local`` (other threads'
  launches, e.g. an engine's, go on), without ``torch.cuda.graph``'s device-wide synchronize and cache emptying, and
  without a host wait: the caller's stream waits for the side stream.
- Until the forty-sixth session a graph gathered into a landing buffer kept with it (one per buffer and plan), then
  copied into the slot: the copy doubled the fill's GPU time (~0.13 ms more for the 8B rank 16 at TP 1 on an H100) and
  each graph held its shard's size of GPU memory.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple

import torch

from workers.lru import BoundedLRU
from workers.reads.device import DeviceRead, check_buffers, issue_read

log = logging.getLogger(__name__)

NO_ROOM = object()  # a capture the GPU had no room for: that buffer's loads launch their kernels

GRAPH_MAX_BYTES = 256 << 20  # shards up to this are filled by a graph (the 8B rank-16's: 84 MB at TP 1; the 70B
# rank-64's, ~0.8 GB at TP 2, are not: their gather is GPU time, not launches)
KEEP_GRAPHS = 64  # a rank's graphs kept (each a few kernel nodes and the finite proof's scratch: no shard-sized buffer)


class FillGraph(NamedTuple):
    """One captured fill: its graph, which gathers into the slot it was captured for, and the device flag it proves
    that slot's shard finite into."""

    graph: Any
    flag: torch.Tensor
    plan: Any  # the read's gather plan it was captured for (kept: the key holds its id)
    lock: threading.Lock

    def fill(self, host_flag: torch.Tensor) -> None:
        """On the current stream: the graph, then its flag into ``host_flag``."""
        with self.lock:
            self.graph.replay()
            host_flag.copy_(self.flag, non_blocking=True)


class FillGraphs:
    """A rank's fill graphs (the module's docstring), made on first use of an (image, plan); ``captures`` counts."""

    def __init__(self, keep: int = KEEP_GRAPHS, max_bytes: int = GRAPH_MAX_BYTES, flags: int = 16) -> None:
        self.keep, self.max_bytes, self.flags = keep, max_bytes, flags
        # (image address, size, id(plan), slot address, shard elements) -> its graph, or NO_ROOM: the GPU had none for
        # its capture
        self._graphs: BoundedLRU[tuple[int, int, int, int, int], FillGraph | object] = BoundedLRU(keep)
        self._lock = threading.Lock()  # one capture at a time, and the flags
        self._flags: list[torch.Tensor] = []  # pinned finite flags given back, for the next loads
        self.captures = 0

    def flag(self, pinned: bool) -> torch.Tensor:
        """A one-element bool flag for a load (pinned for a GPU's), a kept one if any."""
        with self._lock:
            if pinned and self._flags:
                return self._flags.pop()
        return torch.ones((), dtype=torch.bool, pin_memory=pinned)

    def give(self, flag: torch.Tensor) -> None:
        """A load's flag, read (its copy completed): kept for another load."""
        if flag.is_pinned():
            with self._lock:
                if len(self._flags) < self.flags:
                    self._flags.append(flag)

    def get(self, read: DeviceRead, image: torch.Tensor, dest: torch.Tensor) -> FillGraph | None:
        """The graph of ``read`` from ``image`` into ``dest`` (a slot; checked as ``read_image`` checks it), captured
        now if new (on the current stream's work so far: the caller's waits first), or None where a graph does not
        pay: not on a GPU, a shard over ``max_bytes``, or conversions."""
        if not image.is_cuda or read.converts or read.layout.nbytes > self.max_bytes:
            return None
        check_buffers(read, image, dest)
        key = (image.data_ptr(), image.numel(), id(read.gather), dest.data_ptr(), read.layout.numel)
        with self._lock:
            kept = self._graphs.get(key)
            if kept is NO_ROOM:
                return None
            if isinstance(kept, FillGraph) and kept.plan is read.gather:
                return kept
            try:
                made = _capture(read, image, dest)
            except torch.OutOfMemoryError:  # the GPU's memory is the engine's: these loads launch as before
                log.warning("no GPU room for a fill graph of a %d-byte shard of a pushed image; its loads into that "
                            "slot launch their kernels", read.layout.nbytes)
                self._graphs.put(key, NO_ROOM)
                return None
            self.captures += 1
            self._graphs.put(key, made)
            return made


def _capture(read: DeviceRead, image: torch.Tensor, dest: torch.Tensor) -> FillGraph:
    """The fill of ``dest`` from ``image`` as a graph, on a side stream after the current stream's work so far; the
    current stream waits for the side stream (no host wait). The fill runs once outside the capture (the kernels
    loaded, the allocator warm): into ``dest``, the slot being loaded, after the same waits as the replay."""
    device = image.device
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        issue_read(read, image, dest)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            flag = issue_read(read, image, dest)
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return FillGraph(graph, flag, read.gather, threading.Lock())
