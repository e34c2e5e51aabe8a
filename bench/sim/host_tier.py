"""One rank's pinned host tier in simulated time (``workers.staging.host_tier.HostTier``'s rules) and its warm
stages (``workers.staging.warming.WarmQueue``'s): a split of ``bench/sim/worker.py`` along its seam (lifecycle step 5).

``SimHostTier``: staged shards by key, counted in bytes, let go of in ``workers.staging.eviction``'s order
(``SimConfig.host_eviction``: LRU by default), single-flight reads on ``read_threads`` reader
threads (from the page cache at the calibration's cost, or from a ``SimStore``), fetches that wait FIFO for room held
by loads in flight; it tells ``on_change`` what it holds as it changes ("staged" once read, "unstaged" when the tier
lets go of it), as the real tier's deltas do. ``SimWarmQueue``: speculative stages, one at a time, only while no
other read is in flight or waiting, nor a demand read of another rank on the same store
(``workers.staging.node_reads``). The tier is counted in bytes; the real arena's fragmentation is not modelled.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from bench.sim.calibration import Calibration
from bench.sim.events import Loop, Signal
from bench.sim.store import SimStore
from lora_cache.errors import CapacityError
from lora_cache.vocab import AdapterKey
from workers.staging.disk_tier import DiskTierConfig
from workers.staging.eviction import RECENT_S, EvictionOrder
from workers.staging.node_reads import StoreShare


@dataclass(eq=False)
class _Staged:
    nbytes: int
    staged: Signal  # fires when the read ends (failed: the fetch waited for room that never came)
    refs: int = 1
    read_ms: float = 0.0
    speculative: bool = False  # a warm stage's read: no demand read for the node's other ranks (``NodeReads``)
    protected: bool = False  # ``HostEntry.protected``: let go of after every idle unprotected entry
    touched: float = 0.0  # ``HostEntry.touched``: its read's start, last fetch or write-back (simulated seconds)


@dataclass
class NoWays:
    """The simulator's side of ``workers.staging.read_ways.ColdReads``: a simulated read has a time, not a way, so
    no cold read is counted as going one (``WorkerCache.stats``' ``cold_<way>`` stay 0)."""

    went: dict[str, int] = field(default_factory=dict)


class SimHostTier:
    """The pinned host tier of one rank: staged shards, bytes, eviction order, single-flight reads, references."""

    def __init__(self, loop: Loop, calibration: Calibration, capacity: int, read_threads: int,
                 store: SimStore | None = None, eviction: str = "lru", tiers: str = "exclusive",
                 recent_s: float = RECENT_S) -> None:
        """``store``: where a miss reads from (``bench.sim.store``: device, s3); None: the page cache. ``eviction``:
        ``HostTierConfig.eviction``; ``tiers``: ``HostTierConfig.tiers`` (exclusive: ``write_back``, ``drop``)."""
        self.loop, self.calibration, self.capacity = loop, calibration, capacity
        self.exclusive = tiers == "exclusive"
        self.store = store
        if store is not None:
            store.tiers.append(self)  # the node's ranks on that store: their warm stages yield to its demand reads
        self._busy = 0  # store reads: reader threads busy
        self._queue: deque[tuple[AdapterKey, _Staged]] = deque()  # store reads waiting for a reader thread
        self.entries: OrderedDict[AdapterKey, _Staged] = OrderedDict()  # oldest first
        self.used = 0
        self.order = EvictionOrder(capacity, eviction, recent_s)  # which idle entry goes first (``HostTier.order``)
        self.hits = self.misses = self.bytes_read = self.waits = 0
        self.written_back = 0  # shards taken back from a GPU slot (``write_back``)
        self.cold = NoWays()
        # how much of the last minute this rank's demand reads waited for the store (``DiskTier.store_share``), and
        # past which an evicted shard's disk copy becomes the most recent (``DiskTier.let_go``)
        self.store_share = StoreShare(clock=lambda: loop.now)
        self.victim_share = DiskTierConfig().victim_share
        self._waiting: OrderedDict[AdapterKey, _Staged] = OrderedDict()  # fetches waiting for room, FIFO
        # heap: when each reader thread is free (FIFO pool); free from the start, which may be before t=0 (settle_s)
        self._readers = [-math.inf] * read_threads
        self._reads: list[tuple[float, float]] = []  # (start, end) of reads not yet known to be over
        self.on_read: Callable[[float, float], None] | None = None  # told (start, end) of each read placed
        # told (key, True) once a read put a shard here, (key, False) when the LRU drops it (``HostTier.on_change``)
        self.on_change: Callable[[AdapterKey, bool], None] | None = None

    def fetch(self, key: AdapterKey, nbytes: int, count: bool = True, wait: bool = False,
              speculative: bool = False) -> tuple[_Staged, bool]:
        """The staged entry (referenced) and whether it was a hit; CapacityError if it cannot be staged.
        ``count``: a lookup for a GPU load (``HostTier.fetch``), not a stage ahead of one. ``wait``: with
        every byte held by loads in flight, wait (FIFO) for room instead (``HostTier.fetch``'s rules)."""
        entry = self.entries.get(key) or self._waiting.get(key)
        if entry is not None:  # staged, or a read in flight or waiting (single flight)
            if key in self.entries:
                self.entries.move_to_end(key)
                entry.protected, entry.touched = self.order.used_again(entry.protected), self.loop.now
            if entry.speculative and not speculative and not entry.staged.done:  # ``DemandMarks.join``: a demand
                entry.speculative = False  # read now, whose store fetch yields no more
                if self.store is not None:
                    self.store.promote(key.name)
            entry.refs += 1
            self.hits += count
            return entry, True
        if nbytes > self.capacity:
            raise CapacityError(f"host tier ({self.capacity} bytes) can never stage {key}: its shard ({nbytes} "
                                f"bytes) is larger than the whole tier; raise host_bytes to at least {nbytes} bytes")
        entry = _Staged(nbytes, Signal(), speculative=speculative)
        if not self._waiting and self._make_room(nbytes):  # no room taken ahead of a wait
            entry.protected = self.order.admitted(key, speculative)
            self._read(key, entry)
        elif wait and (self._waiting or self._may_free()):
            self._waiting[key] = entry
            self.waits += 1
        else:
            raise CapacityError(f"host tier ({self.capacity} bytes) cannot stage {key} ({nbytes} bytes): "
                                "the rest is held by loads in flight")
        self.misses += count
        return entry, False

    def _read(self, key: AdapterKey, entry: _Staged) -> None:
        """Stage ``entry`` (its room is made): a read on the first free reader thread."""
        entry.touched = self.loop.now
        self.entries[key] = entry
        self.used += entry.nbytes
        if self.store is not None:
            self._queue.append((key, entry))
            self._pump()
            return
        now = self.loop.now
        start = max(now, heapq.heappop(self._readers))
        end = start + self.calibration.disk_s(entry.nbytes)
        heapq.heappush(self._readers, end)
        self._reads.append((start, end))
        if self.on_read is not None:
            self.on_read(start, end)
        entry.read_ms = (end - start) * 1e3
        self.loop.at(end, self._read_done, key, entry)

    def demand_reading(self) -> bool:
        """A read that is not a warm stage's in flight or waiting (``NodeReads``: what the node's other ranks see)."""
        return bool(self._waiting) or any(not e.speculative and not e.staged.done for e in self.entries.values())

    def waiting(self) -> int:
        """Fetches waiting for room, and store reads waiting for a reader thread."""
        return len(self._waiting) + len(self._queue)

    def read_ends(self, now: float) -> list[float]:
        """When the reads placed and not over at ``now`` end."""
        return [b for _, b in self._reads if b > now]

    def _pump(self) -> None:
        """Store reads: start the waiting ones on free reader threads (FIFO); each ends when the store says."""
        assert self.store is not None
        while self._queue and self._busy < len(self._readers):
            key, entry = self._queue.popleft()
            self._busy += 1
            span = (self.loop.now, math.inf)
            self._reads.append(span)
            copy = self.store.on_disk.get(key.name)  # a demand read of an object not on the disk waits for the store
            waits = not entry.speculative and self.store.model.kind == "s3" and not (copy is not None and copy.done)
            if waits:
                self.store_share.add(1)
            self.store.read(key.name, entry.nbytes, functools.partial(self._store_done, key, entry, span, waits),
                            background=entry.speculative)  # a warm stage's fetch yields (``DemandMarks.yields``)

    def _store_done(self, key: AdapterKey, entry: _Staged, span: tuple[float, float], waited: bool) -> None:
        if waited:
            self.store_share.add(-1)
        self._busy -= 1
        start, end = span[0], self.loop.now
        self._reads[self._reads.index(span)] = (start, end)
        if self.on_read is not None:
            self.on_read(start, end)
        entry.read_ms = (end - start) * 1e3
        self._read_done(key, entry)
        self._pump()

    def reads_in_flight(self, now: float) -> int:
        """Reads running at ``now``: what slows a step of the engine in the same process."""
        self._reads = [(a, b) for a, b in self._reads if b > now]
        return sum(a <= now for a, _ in self._reads)

    def release(self, key: AdapterKey) -> None:
        entry = self.entries[key]
        assert entry.refs > 0, f"host entry {key} released more often than fetched"
        entry.refs -= 1
        self._admit()

    def _read_done(self, key: AdapterKey, entry: _Staged) -> None:
        self.bytes_read += entry.nbytes
        if self.on_change is not None:
            self.on_change(key, True)
        entry.staged.fire(self.loop.now)
        self._admit()  # unreferenced once read (a stage's entry): its room is the LRU's

    def write_back(self, key: AdapterKey, nbytes: int, done_s: float) -> bool:
        """``HostTier.write_back``: take in the shard a GPU slot lets go of, whole at ``done_s`` (its device-to-host
        copy's end; a fetch meanwhile joins it); False, nothing changed, if the tier holds or reads it already, a
        fetch waits for room, or idle entries cannot make room for it."""
        if key in self.entries or self._waiting or nbytes > self.capacity or not self._make_room(nbytes):
            return False
        entry = _Staged(nbytes, Signal(), refs=0, speculative=True)  # no store read: nothing for the node to yield to
        entry.protected, entry.touched = self.order.written_back(key), self.loop.now
        self.entries[key] = entry
        self.used += nbytes
        self.written_back += 1
        self.loop.at(done_s, self._written, key, entry)
        return True

    def _written(self, key: AdapterKey, entry: _Staged) -> None:
        if self.on_change is not None:
            self.on_change(key, True)
        entry.staged.fire(self.loop.now)
        self._admit()

    def drop(self, key: AdapterKey) -> bool:
        """``HostTier.drop``: let go of an idle, staged entry now (exclusive tiers: once its GPU load is READY)."""
        entry = self.entries.get(key)
        if entry is None or entry.refs or not entry.staged.done:
            return False
        del self.entries[key]
        self.used -= entry.nbytes
        if self.on_change is not None:
            self.on_change(key, False)
        self._admit()
        return True

    def _make_room(self, nbytes: int) -> bool:
        """Evict idle staged entries (``victim``'s order) until ``nbytes`` fit; False (evicting none) if they are
        not enough."""
        idle = sum(e.nbytes for e in self.entries.values() if e.refs == 0 and e.staged.done)
        if self.used - idle + nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            key = self.order.victim(self.entries.items(), lambda e: e.refs == 0 and e.staged.done, self.loop.now)
            if key is None:
                return False
            self.used -= (gone := self.entries.pop(key).nbytes)
            self.order.evicted(key, gone)
            if self.store is not None and self.store_share.past(self.victim_share):
                self.store.touch(key.name)  # ``DiskTier.let_go``: the disk a victim cache while the store is saturated
            if self.on_change is not None:
                self.on_change(key, False)
        return True

    def _may_free(self) -> bool:
        """Whether room may still come: an entry referenced (by a load in flight) or being read."""
        return any(e.refs or not e.staged.done for e in self.entries.values())

    def _admit(self) -> None:
        """Start the reads of waiting fetches that fit now, oldest first (the head waits for room rather
        than let later ones pass it); fail those that never will fit (``HostTier._admit``)."""
        while self._waiting:
            key, entry = next(iter(self._waiting.items()))
            fits = self._make_room(entry.nbytes)
            if not fits and self._may_free():
                return
            del self._waiting[key]
            if fits:
                entry.protected = self.order.admitted(key, entry.speculative)
                self._read(key, entry)
            else:
                entry.staged.fire(self.loop.now, ok=False)

    def check_integrity(self) -> None:
        assert self.used == sum(e.nbytes for e in self.entries.values()) <= self.capacity, "host bytes disagree"
        self.order.check_integrity()
        assert not set(self._waiting) & set(self.entries), "a waiting fetch already has an entry"
        assert not self._waiting or self._may_free(), "a fetch waits with nothing in flight to free room"


class SimWarmQueue:
    """``WarmQueue``: warm stages in the order sent (once each while queued), started one at a time, only while the
    host tier has no other read in flight or waiting; else looked at again when the reads in flight end."""

    def __init__(self, loop: Loop, host: SimHostTier, keys: Mapping[str, AdapterKey],
                 stage: Callable[[str], bool]) -> None:
        """``stage(name)``: the worker's stage (True if it started a read or found one)."""
        self.loop, self.host, self.keys, self.stage = loop, host, keys, stage
        self._queued: OrderedDict[str, bool] = OrderedDict()  # warm stages not started, in order sent: disk-only?
        self._reading = False  # a warm read in flight (one at a time)
        self._wake = math.inf  # when a look at the queue is scheduled (inf: none)

    def add(self, name: str, disk: bool = False) -> None:
        """A warm stage (``disk``: a disk warm stage, the object fetched into the node's disk tier only; a host one
        of a name queued for the disk makes it a host one, as ``CommandGate`` does)."""
        if name not in self._queued or not disk:
            self._queued[name] = disk
        self.pump()

    def pump(self) -> None:
        """Start the next warm stage if no other read is in flight or waiting."""
        while self._queued and not self._reading:
            now = self.loop.now
            others = self.host.store.tiers if self.host.store is not None else []
            if self.host.read_ends(now) or self.host.waiting() or any(
                    t.demand_reading() for t in others if t is not self.host):  # ``NodeReads.busy``
                ends = [end for end in self.host.read_ends(now) if end < math.inf]  # a store read's end is unknown
                wake = min(ends) if ends else now + 0.01
                if wake < self._wake or self._wake <= now:
                    self._wake = wake
                    self.loop.at(wake, self.pump)
                return
            name, disk = self._queued.popitem(last=False)
            if disk:
                copy = self.host.store.fetch(name, background=True) if self.host.store is not None and \
                    name in self.keys else None
                if copy is not None and not copy.done:
                    self._reading = True
                    copy.then(lambda _: self._done())
            elif name in self.keys and self.stage(name):
                self._reading = True
                self.host.entries[self.keys[name]].staged.then(lambda _: self._done())

    def _done(self) -> None:
        self._reading = False
        self.pump()
