"""A pushed image's fill as one CUDA graph (lifecycle step 5, the device source of a push; issue 44 item 5).

A rank's fill from a trainer's image (``workers.reads.device.read_image``) is a few launches: the gather, the finite
proof's sum and test. On one H100 their host time is ~0.15 ms alone, hot, and ~0.4-0.6 ms inside a load, the most of
an 8B rank-16 push's rank-side part (bench/reports/issue-44.md, "the rank's own part"), while the GPU does ~0.05 ms of
work. A trainer pushes every version of an adapter from the same buffer with the same header, so the same launches
run on the same addresses each time: captured once into a graph, each fill is one graph launch into a landing buffer
kept with it, then one device-to-device copy into the slot (a slot's address changes from load to load; the copy is
~10 us of GPU time for such a shard).

- ``FillGraphs``: a rank's graphs, one per (image address, image size, read plan), the last ``keep`` (each holds a
  landing buffer of its shard's size on the GPU); a shard over ``max_bytes`` (the 70B's, whose fill is GPU time, not
  launches), a plan with dtype conversions, or a capture the GPU has no room for (remembered) gets none and is
  filled by ``read_image``, as before. It also keeps the loads' pinned finite flags for reuse (``flag``/``give``):
  a pinned allocation costs a load ~0.05-0.1 ms.
- The graph reads the image's bytes when it runs, not when it was captured: a new version in the same buffer is
  gathered anew (the GPU tests push two contents and a NaN through one graph).
- Replays of one graph are serialized (its landing buffer is shared): the replay, the copy into the slot and the
  flag's copy into the load's own pinned flag are issued under the graph's lock, on the caller's stream (the rank's
  copy stream), so a second load's replay is ordered after the first's copies.
- Captured with ``CUDAGraph.capture_begin`` / ``capture_end`` on a side stream, ``thread_local`` (other threads'
  launches, e.g. an engine's, go on), without ``torch.cuda.graph``'s device-wide synchronize and cache emptying.
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
# rank-64's, ~0.8 GB at TP 2, are not: their gather is GPU time, and their landing buffer would cost as much again)


class FillGraph(NamedTuple):
    """One captured fill: its graph, the landing buffer it gathers into, the device flag it proves finite into."""

    graph: Any
    landing: torch.Tensor
    flag: torch.Tensor
    plan: Any  # the read's gather plan it was captured for (kept: the key holds its id)
    lock: threading.Lock

    def fill(self, dest: torch.Tensor, numel: int, host_flag: torch.Tensor) -> None:
        """On the current stream: the graph, then its landing buffer into ``dest`` and its flag into ``host_flag``."""
        with self.lock:
            self.graph.replay()
            dest[:numel].copy_(self.landing, non_blocking=True)
            host_flag.copy_(self.flag, non_blocking=True)


class FillGraphs:
    """A rank's fill graphs (the module's docstring), made on first use of an (image, plan); ``captures`` counts."""

    def __init__(self, keep: int = 4, max_bytes: int = GRAPH_MAX_BYTES, flags: int = 16) -> None:
        self.keep, self.max_bytes, self.flags = keep, max_bytes, flags
        # (image address, size, id(plan)) -> its graph, or NO_ROOM: the GPU had none for its capture
        self._graphs: BoundedLRU[tuple[int, int, int], FillGraph | object] = BoundedLRU(keep)
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

    def get(self, read: DeviceRead, image: torch.Tensor) -> FillGraph | None:
        """The graph of ``read`` from ``image`` (captured now if new), or None where a graph does not pay: not on a
        GPU, a shard over ``max_bytes``, or conversions."""
        if not image.is_cuda or read.converts or read.layout.nbytes > self.max_bytes:
            return None
        key = (image.data_ptr(), image.numel(), id(read.gather))
        with self._lock:
            kept = self._graphs.get(key)
            if kept is NO_ROOM:
                return None
            if isinstance(kept, FillGraph) and kept.plan is read.gather:
                return kept
            try:
                made = _capture(read, image)
            except torch.OutOfMemoryError:  # the GPU's memory is the engine's: this buffer's loads launch as before
                log.warning("no GPU room for a %d-byte fill graph of a pushed image; its loads launch their kernels",
                            read.layout.nbytes)
                self._graphs.put(key, NO_ROOM)
                return None
            self.captures += 1
            self._graphs.put(key, made)
            return made


def _capture(read: DeviceRead, image: torch.Tensor) -> FillGraph:
    device = image.device
    landing = torch.empty(read.layout.numel, dtype=read.layout.dtype, device=device)
    check_buffers(read, image, landing)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        issue_read(read, image, landing)  # once outside the capture: the kernels loaded, the allocator warm
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            flag = issue_read(read, image, landing)
        finally:
            graph.capture_end()
    side.synchronize()
    return FillGraph(graph, landing, flag, read.gather, threading.Lock())
