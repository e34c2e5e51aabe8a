"""The host tier's config (``HostTierConfig``) and its size by default: a share of this host's available memory
over its GPU ranks (``auto_host_bytes``), and how many reader threads and processes a read takes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from lora_cache.errors import ConfigError
from workers.reads.proof import VERIFY
from workers.reads.threads import AUTO_MAX, auto_readers, host_cores
from workers.staging.eviction import EVICTION, RECENT_S
from workers.staging.tier_reads import READS

MAX_READ_PARALLEL = 64
AUTO_MAX_SPLIT = 16  # reader threads per read by default, at most, when split over reader processes
THREADS_PER_PROCESS = 4  # of a read split over processes, by default (issue 30: 8+ threads in one process wait on
# the GIL between their reads; processes share none)
AUTO_SHARE = 0.25  # of this host's available memory, for its ranks' host tiers together (host_bytes 0)
AUTO_MAX_BYTES = 16 << 30  # the operator's cap per rank on the auto size, by default (pinning: ~0.5 s a GiB)
AUTO_MIN_BYTES = 256 << 20  # the auto size never goes below this (a small or busy host)
TIERS = {
    "inclusive": "a GPU-resident shard keeps its host copy: a slot it is evicted from loads it again from there, if "
                 "the host tier's eviction order kept it",
    "exclusive": "a shard is held by one tier at a time: a GPU load lets go of its host copy once READY, and a slot's "
                 "eviction writes the shard back into the host tier (a device-to-host copy in pieces on a stream of "
                 "its own, no store read), so the host tier holds other adapters than the GPU slots do",
}
DIRECT_READS = {
    "off": "through the page cache (the default)",
    "on": "with O_DIRECT (one in the page cache, or on a file system that refuses O_DIRECT, through it): a store of "
          "files on a local device larger than memory is read at the device's rate, with no copy out of the page "
          "cache and nothing left in it (the pinned host tier is the node's copy)",
    "auto": "each file system and shard size tries O_DIRECT, the page cache, and the page cache with the file asked "
            "for whole ahead (read_ahead's way) on its first warm stages' cold reads, then takes the one its reads "
            "measured fastest, trying the others now and then; a read a request waits for goes the way chosen, or "
            "through the page cache until one is (workers/staging/read_ways.py)",
}
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def available_memory() -> int:
    """Bytes this process could still take: ``MemAvailable`` of /proc/meminfo, less where a cgroup (v2)
    limit leaves less room (a container sees the host's meminfo)."""
    avail = 0
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if not avail:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            avail = 0
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((CGROUP / "memory.current").read_text().strip())
            avail = min(avail, room) if avail else room
    except (OSError, ValueError):
        pass
    return max(0, avail)


def auto_host_bytes(available: int, ranks_here: int, share: float = AUTO_SHARE,
                    cap: int = AUTO_MAX_BYTES) -> int:
    """Each rank's host tier by default: ``share`` of ``available`` bytes over the ``ranks_here`` GPU ranks of
    this host, at most ``cap``, at least ``AUTO_MIN_BYTES`` (or ``cap`` if lower), in whole MiB."""
    size = min(cap, max(AUTO_MIN_BYTES, int(share * available) // max(1, ranks_here)))
    return max(1 << 20, size >> 20 << 20)


@dataclass(frozen=True)
class HostTierConfig:
    """Size of the host tier and its reader pool."""

    host_bytes: int = field(default=0, metadata={
        "help": "bytes of (pinned) host memory for staged shards, per rank; 0: auto, host_share of this host's "
                "available memory (MemAvailable, or a lower cgroup limit) over its GPU ranks, at most "
                "host_max_bytes, at least 256 MiB"})
    host_share: float = field(default=AUTO_SHARE, metadata={
        "help": "host_bytes 0 (auto): the share of this host's available memory its ranks' host tiers take together"})
    host_max_bytes: int = field(default=AUTO_MAX_BYTES, metadata={
        "help": "host_bytes 0 (auto): the operator's cap on each rank's host tier"})
    read_threads: int = field(default=4, metadata={"help": "reads of adapter files at once (threads, and reader "
                                                           "processes with reads=process)"})
    read_parallel: int = field(default=0, metadata={
        "help": "reader threads that split one read (positioned reads straight into the pinned arena, in chunk "
                "order); 0: auto, the host's cores over its GPU ranks, at most 8 in one process (thread reads), at "
                "most 16 over reader processes (process reads); 1: one thread"})
    read_split: int = field(default=0, metadata={
        "help": "process reads: reader processes that split one read, as many as are idle up to this (each with "
                "read_parallel / read_split threads: no GIL shared among them); 0: auto, one per 4 reader threads, "
                "at most read_threads; 1: one process per read"})
    pin: bool = field(default=True, metadata={"help": "pin host memory when a GPU is present"})
    pin_background: bool = field(default=True, metadata={
        "help": "pin a shared arena (process reads) on a thread of its own while the worker starts (6-9 s for 16 "
                "GiB); the first copy from it waits for the pinning; off: pin before the worker starts"})
    reads: str = field(default="auto", metadata={
        "help": "where reads run: process (reader processes sharing the arena), thread (the reader threads), "
                "auto (process when the arena is pinned for a GPU, else thread)"})
    verify: str = field(default="sample", metadata={
        "help": "how much of each read is checked against the CRCs taken at registration, beyond the file's "
                "identity and header: " + "; ".join(f"{k} ({v})" for k, v in VERIFY.items())})

    warm_read_bytes_per_s: int = field(default=0, metadata={
        "help": "the store read rate this node's warm stages (speculative reads ahead of demand, "
                "workers/staging/warming.py) may use, in bytes per second, shared evenly by its GPU ranks (object "
                "stores bill and throttle); reads for requests are never held back by it (0: no limit)"})
    eviction: str = field(default="lru", metadata={
        "help": "which idle shard the tier lets go of first: " + "; ".join(f"{k} ({v})" for k, v in EVICTION.items())})
    recent_s: float = field(default=RECENT_S, metadata={
        "help": "eviction popular: a shard touched (read in, fetched, written back) this many seconds ago or less goes "
                "after every other, so an adapter newly popular is not let go of before the fleet's counts rank it "
                "(0: rank alone)"})
    tiers: str = field(default="exclusive", metadata={
        "help": "whether the GPU slots and the host tier may hold the same shard: " + "; ".join(
            f"{k} ({v})" for k, v in TIERS.items())})
    read_ahead: bool = field(default=False, metadata={
        "help": "ask the kernel for an adapter file that is not in the page cache whole at once, as its read starts "
                "(POSIX_FADV_WILLNEED, off the readers' threads): a read from the device then runs at the device's "
                "queue depth, not the readers' (a file in the page cache is left alone)"})
    direct_reads: str = field(default="off", metadata={
        "help": "how an adapter file that is out of the page cache is read: " + "; ".join(
            f"{k} ({v})" for k, v in DIRECT_READS.items()) + " (True / False: on / off)"})
    drop_page_cache: bool = field(default=False, metadata={
        "help": "drop an adapter file's pages after its shard is read: the pinned host tier is the node's copy, so "
                "the page cache does not hold a second one (and a benchmark reads from the device as a cold store "
                "would)"})

    def __post_init__(self) -> None:
        if self.host_bytes != 0 and self.host_bytes < 1 << 20:
            raise ConfigError(f"host_bytes ({self.host_bytes}) must be at least 1 MiB, or 0 (auto: a share of this "
                              "host's available memory)")
        if not 0 < self.host_share <= 0.9:
            raise ConfigError(f"host_share must be in (0, 0.9] (a share of this host's available memory for its "
                              f"ranks' host tiers together), got {self.host_share}")
        if self.host_max_bytes < 1 << 20:
            raise ConfigError(f"host_max_bytes ({self.host_max_bytes}) must be at least 1 MiB")
        if not 1 <= self.read_threads <= 64:
            raise ConfigError(f"read_threads must be in 1..64, got {self.read_threads}")
        if not 0 <= self.read_parallel <= MAX_READ_PARALLEL:
            raise ConfigError(f"read_parallel must be 0 (auto: {AUTO_MAX} at most, fewer where the host has fewer "
                              f"cores per GPU rank) or 1..{MAX_READ_PARALLEL} reader threads per read, got "
                              f"{self.read_parallel}; 1 reads in one thread")
        if not 0 <= self.read_split <= self.read_threads:
            raise ConfigError(f"read_split must be 0 (auto) or 1..read_threads ({self.read_threads}) reader processes "
                              f"per read, got {self.read_split}; raise read_threads to split reads more")
        if self.warm_read_bytes_per_s < 0:
            raise ConfigError(f"warm_read_bytes_per_s is {self.warm_read_bytes_per_s}; give bytes per second >= 0, "
                              "e.g. 200000000 (0: no limit on warm reads)")
        if self.reads not in ("auto", *READS):
            raise ConfigError(f"reads {self.reads!r} is not one of auto, {', '.join(READS)}; pick one of them")
        if self.eviction not in EVICTION:
            raise ConfigError(f"eviction {self.eviction!r} is not one of {', '.join(EVICTION)}; pick one of them "
                              "(lru is the default)")
        if not (isinstance(self.recent_s, (int, float)) and 0 <= self.recent_s < float("inf")):
            raise ConfigError(f"recent_s is {self.recent_s!r}; give seconds >= 0, e.g. {RECENT_S} (0: rank alone)")
        if self.tiers not in TIERS:
            raise ConfigError(f"tiers {self.tiers!r} is not one of {', '.join(TIERS)}; pick one of them "
                              "(inclusive is the default)")
        if self.verify not in VERIFY:
            raise ConfigError(f"verify {self.verify!r} is not one of {', '.join(VERIFY)}; pick one of them "
                              "(sample is the default)")
        if isinstance(self.direct_reads, bool):  # the setting's first form (a flag): on or off
            object.__setattr__(self, "direct_reads", "on" if self.direct_reads else "off")
        if self.direct_reads not in DIRECT_READS:
            raise ConfigError(f"direct_reads {self.direct_reads!r} is not one of {', '.join(DIRECT_READS)}; pick one "
                              "of them (off is the default; auto measures each way on each file system)")
        if self.read_ahead and self.direct_reads != "off":
            raise ConfigError(f"read_ahead is on and direct_reads is {self.direct_reads!r}: read_ahead asks the page "
                              "cache for a file that direct reads never read from it; turn read_ahead off or set "
                              "direct_reads off")

    @property
    def auto(self) -> bool:
        """Whether ``host_bytes`` follows the host's memory (0)."""
        return self.host_bytes == 0

    def sized(self, ranks_here: int, available: int | None = None) -> HostTierConfig:
        """This config with ``host_bytes`` resolved: as given, or for 0 (auto) ``auto_host_bytes`` of this host's
        ``available_memory()`` (or ``available``) over ``ranks_here`` GPU ranks."""
        if not self.auto:
            return self
        free = available_memory() if available is None else available
        return replace(self, host_bytes=auto_host_bytes(free, ranks_here, self.host_share, self.host_max_bytes))

    def readers(self, ranks_here: int, processes: bool = False) -> int:
        """Reader threads per read: ``read_parallel``, or for 0 the host's cores shared by ``ranks_here`` GPU ranks
        (``processes``: reads split over reader processes, no GIL shared: up to ``AUTO_MAX_SPLIT``)."""
        return self.read_parallel or auto_readers(host_cores(), ranks_here, AUTO_MAX_SPLIT if processes else AUTO_MAX)

    def splits(self, readers: int) -> int:
        """Reader processes per read (process reads) for ``readers`` threads: ``read_split``, or for 0 one per
        ``THREADS_PER_PROCESS`` threads, at most ``read_threads``."""
        return self.read_split or max(1, min(self.read_threads, readers // THREADS_PER_PROCESS))

    def reads_for(self, pinned: bool) -> str:
        """The strategy ``auto`` stands for: processes when the arena is pinned (a GPU), else threads."""
        return ("process" if pinned else "thread") if self.reads == "auto" else self.reads
