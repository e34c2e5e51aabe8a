"""Counters of the worker cache: hits and misses per tier, bytes moved, load and readiness times."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Protocol


class Reservoir:
    """The last ``maxlen`` samples (bounded), summarised as count / mean / p50 / p99."""

    def __init__(self, maxlen: int = 4096) -> None:
        self.samples: deque[float] = deque(maxlen=maxlen)
        self.count = 0

    def add(self, value: float) -> None:
        self.samples.append(value)
        self.count += 1

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"count": 0}
        s = sorted(self.samples)
        pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
        return {"count": self.count, "mean": sum(s) / len(s), "p50": pick(0.5), "p99": pick(0.99)}


@dataclass
class CacheCounters:
    gpu_hits: int = 0  # acquire found the adapter resident (ready or loading)
    gpu_misses: int = 0  # acquire had to start a load
    prefetches: int = 0  # loads started ahead of need, by prefetch()
    demand_loads: int = 0  # loads started by an acquire that missed
    image_loads: int = 0  # prefetches taken from a pushed image on the device (``WorkerCache.load_image``)
    loads: int = 0  # copies that completed
    load_failures: int = 0
    prefetch_no_room: int = 0  # prefetches dropped because every slot was held by running batches (not failures)
    slot_waits: int = 0  # on-demand loads that waited for a running batch to let go of a slot
    evictions: int = 0
    prefetch_used: int = 0  # prefetched loads a batch acquired before their eviction
    prefetch_unused: int = 0  # prefetched loads evicted without ever being acquired
    bytes_host_to_gpu: int = 0
    bytes_from_images: int = 0  # shard bytes gathered from pushed images on the device (not host -> GPU)
    stages: int = 0  # host-tier reads started by stage(): a needed adapter's shard read ahead of its slot
    stage_failures: int = 0  # stages refused for host-tier room, or whose read failed
    disk_ms: Reservoir = field(default_factory=Reservoir)  # disk -> host staging, per load that read the disk
    h2d_ms: Reservoir = field(default_factory=Reservoir)  # one packed copy, measured by events
    ready_ms: Reservoir = field(default_factory=Reservoir)  # prefetch/miss -> READY

    def retired(self, prefetched: bool, used: bool) -> None:
        """A load's slot was freed: an eviction, and for a prefetched load, whether a batch used it first."""
        self.evictions += 1
        if prefetched:
            self.prefetch_used += used
            self.prefetch_unused += not used

    def snapshot(self) -> dict[str, object]:
        return {k: (v.summary() if isinstance(v, Reservoir) else v) for k, v in vars(self).items()}


class _Load(Protocol):
    prefetched: bool
    used: bool


def resident_prefetches(loads: Iterable[_Load]) -> dict[str, int]:
    """Prefetched loads still in their slots, used by a batch or not: with the retired ones
    (``prefetch_used`` / ``prefetch_unused``) they give a prefetch accuracy that also counts loads the run
    ended on (a fleet that places its catalog once evicts almost nothing)."""
    used = unused = 0
    for load in loads:
        if load.prefetched:
            used += load.used
            unused += not load.used
    return {"prefetch_resident_used": used, "prefetch_resident_unused": unused}


class _Ordered(Protocol):
    rankings: int


class _Ways(Protocol):
    went: dict[str, int]


class _HostTier(Protocol):  # workers.staging.host.HostTier, bench.sim.host_tier.SimHostTier
    hits: int
    misses: int
    waits: int
    written_back: int
    bytes_read: int

    @property
    def order(self) -> _Ordered: ...

    @property
    def cold(self) -> _Ways: ...


COLD_WAYS = ("direct", "preadv", "ahead")  # the ways a cold read of a local file goes (workers.staging.read_ways)
HOST_COUNTERS = ("host_hits", "host_misses", "host_waits", "host_written_back", "bytes_disk_to_host", "host_rankings",
                 *(f"cold_{way}" for way in COLD_WAYS))


def host_counts(tier: _HostTier) -> dict[str, int]:
    """A host tier's counters as ``WorkerCache.stats()`` names them (``host_rankings``: the Ranking commands its
    order took, issue 42's ``popular``; ``cold_<way>``: its reads of local files found cold, demand and warm, by the
    way each went, ``workers.staging.read_ways``)."""
    values = (tier.hits, tier.misses, tier.waits, tier.written_back, tier.bytes_read, tier.order.rankings,
              *(tier.cold.went.get(way, 0) for way in COLD_WAYS))
    return dict(zip(HOST_COUNTERS, values, strict=True))


# What WorkerCache.stats() counts (rather than reports as a level): CacheCounters' counts plus the host
# tier's, in that order; and its latency summaries (the load records have every load's timings).
STATS_COUNTERS = (*(f.name for f in fields(CacheCounters) if f.type in (int, "int")), *HOST_COUNTERS)
STATS_SUMMARIES = tuple(f.name for f in fields(CacheCounters) if f.name not in STATS_COUNTERS)
