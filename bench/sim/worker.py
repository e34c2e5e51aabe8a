"""One TP rank's adapter cache in simulated time: ``workers.cache.WorkerCache``'s behaviour, step by step.

The slot bookkeeping is the real ``workers.gpu.slots.SlotTable`` and the counters the real
``workers.counters.CacheCounters``; what this module adds is time. It follows the worker cache's rules
(lifecycle steps 5-7, 9) and the command gate's (step 4):

- a load stages the shard in the host tier (a hit, or a read on one of ``read_threads`` reader
  threads; if every byte is held by loads in flight, it waits, FIFO, for one to let go of its entry,
  and fails only if none could), and only then takes a slot: a FREE one, else the least recently used idle READY one
  (evicted); if every slot is loading or in use it waits for a load to finish when one could free
  a slot, and fails otherwise;
- the copy holds the rank's one copy stream (copies queue in order); READY ``load_fixed_ms`` later;
- ``hold`` is one adapter of ``acquire``: a hit if the adapter has a slot (ready or loading), else a
  miss that starts an on-demand load; the engine waits until that load is issued, then holds it;
- ``pins`` (pins.py) are ``acquire_ready`` (the overlap rule's pins); ``evict`` frees only idle READY slots;
- every residency change goes to the controller as one delta, whoever made it, as ``WorkerCache``
  reports them to the worker actor's outbox (``on_change``): "gone" for the slot ``SlotTable.reserve``
  evicts, then "loading" when a load takes a slot, "ready", "gone" for ``evict``, "failed" for a
  started load that found no GPU room, or no host-tier room with nothing in flight to free it;
- ``apply`` is ``CommandGate.apply``: evicts, then prefetches; an evict refused because the adapter is
  loading or in use reports its state again (``WorkerCache.restate``: "in_use" if a batch holds it).
  A simulated command always names a known adapter, so no prefetch is refused.

The host tier is counted in bytes (LRU of unreferenced staged shards); the real arena's fragmentation
is not modelled. Every rank of a replica holds shards of one size (TP splits are even).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from bench.sim.calibration import Calibration
from bench.sim.events import Loop, Signal
from bench.sim.pins import SimPins
from bench.sim.store import SimStore
from lora_cache.errors import CapacityError
from lora_cache.vocab import AdapterKey, Command, Evict, Stage
from workers.counters import STATS_COUNTERS, CacheCounters, resident_prefetches
from workers.engine.admission import CopyClock
from workers.gpu.slots import SlotPhase, SlotTable

# (adapter, version, loading|ready|gone|failed, error, read_s): what the controller takes (read_s: a READY's store read)
Delta = tuple[str, str, str, str, float]


class LoadRecord(NamedTuple):
    """One completed load on one rank (time-to-ready is ``ready_s - start_s``)."""

    replica: str
    rank: int
    adapter: str
    start_s: float  # prefetch or miss
    ready_s: float
    nbytes: int
    host_hit: bool
    disk_ms: float  # the read alone (0 on a host-tier hit)
    h2d_ms: float  # the copy alone
    prefetched: bool  # False: started by an acquire that missed

    def as_log(self) -> dict[str, object]:
        """The fields ``fit_calibration`` reads (those of ``workers.gpu.copies.ReadinessRecord``, and the real
        load log's READY time ``t_s``, replica and rank)."""
        return {"nbytes": self.nbytes, "ready_ms": (self.ready_s - self.start_s) * 1e3, "h2d_ms": self.h2d_ms,
                "disk_ms": self.disk_ms, "host_hit": self.host_hit, "t_s": self.ready_s, "replica": self.replica,
                "rank": self.rank}


@dataclass(eq=False)
class SimLoad:
    """One adapter's load on one rank: staged on the host, then copied into ``slot``."""

    key: AdapterKey
    nbytes: int
    start_s: float
    prefetched: bool
    issued: Signal = field(default_factory=Signal)  # a slot is reserved and the copy issued (or the load failed)
    ready: Signal = field(default_factory=Signal)  # READY (ok) or failed
    host_hit: bool = False
    slot: int = -1
    disk_ms: float = 0.0
    h2d_ms: float = 0.0
    issued_s: float = 0.0  # when its copy was issued (queued on the rank's copy stream)
    used: bool = False  # some batch acquired (or pinned) it: prefetch accuracy


@dataclass(eq=False)
class _Staged:
    nbytes: int
    staged: Signal  # fires when the read ends (failed: the fetch waited for room that never came)
    refs: int = 1
    read_ms: float = 0.0


class SimHostTier:
    """The pinned host tier of one rank: staged shards, LRU by bytes, single-flight reads, references."""

    def __init__(self, loop: Loop, calibration: Calibration, capacity: int, read_threads: int,
                 store: SimStore | None = None) -> None:
        """``store``: where a miss reads from (``bench.sim.store``: device, s3); None: the page cache."""
        self.loop, self.calibration, self.capacity = loop, calibration, capacity
        self.store = store
        self._busy = 0  # store reads: reader threads busy
        self._queue: deque[tuple[AdapterKey, _Staged]] = deque()  # store reads waiting for a reader thread
        self.entries: OrderedDict[AdapterKey, _Staged] = OrderedDict()  # oldest first
        self.used = 0
        self.hits = self.misses = self.bytes_read = self.waits = 0
        self._waiting: OrderedDict[AdapterKey, _Staged] = OrderedDict()  # fetches waiting for room, FIFO
        # heap: when each reader thread is free (FIFO pool); free from the start, which may be before t=0 (settle_s)
        self._readers = [-math.inf] * read_threads
        self._reads: list[tuple[float, float]] = []  # (start, end) of reads not yet known to be over
        self.on_read: Callable[[float, float], None] | None = None  # told (start, end) of each read placed
        # told (key, True) once a read put a shard here, (key, False) when the LRU drops it (``HostTier.on_change``)
        self.on_change: Callable[[AdapterKey, bool], None] | None = None

    def fetch(self, key: AdapterKey, nbytes: int, count: bool = True, wait: bool = False) -> tuple[_Staged, bool]:
        """The staged entry (referenced) and whether it was a hit; CapacityError if it cannot be staged.
        ``count``: a lookup for a GPU load (``HostTier.fetch``), not a stage ahead of one. ``wait``: with
        every byte held by loads in flight, wait (FIFO) for room instead (``HostTier.fetch``'s rules)."""
        entry = self.entries.get(key) or self._waiting.get(key)
        if entry is not None:  # staged, or a read in flight or waiting (single flight)
            if key in self.entries:
                self.entries.move_to_end(key)
            entry.refs += 1
            self.hits += count
            return entry, True
        if nbytes > self.capacity:
            raise CapacityError(f"host tier ({self.capacity} bytes) can never stage {key}: its shard ({nbytes} "
                                f"bytes) is larger than the whole tier; raise host_bytes to at least {nbytes} bytes")
        entry = _Staged(nbytes, Signal())
        if not self._waiting and self._make_room(nbytes):  # no room taken ahead of a wait
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
            self.store.read(key.name, entry.nbytes, functools.partial(self._store_done, key, entry, span))

    def _store_done(self, key: AdapterKey, entry: _Staged, span: tuple[float, float]) -> None:
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

    def _make_room(self, nbytes: int) -> bool:
        """Evict idle staged entries (LRU) until ``nbytes`` fit; False (evicting none) if they are not enough."""
        idle = sum(e.nbytes for e in self.entries.values() if e.refs == 0 and e.staged.done)
        if self.used - idle + nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            victim = next((k for k, e in self.entries.items() if e.refs == 0 and e.staged.done), None)
            if victim is None:
                return False
            self.used -= self.entries.pop(victim).nbytes
            if self.on_change is not None:
                self.on_change(victim, False)
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
                self._read(key, entry)
            else:
                entry.staged.fire(self.loop.now, ok=False)

    def check_integrity(self) -> None:
        assert self.used == sum(e.nbytes for e in self.entries.values()) <= self.capacity, "host bytes disagree"
        assert not set(self._waiting) & set(self.entries), "a waiting fetch already has an entry"
        assert not self._waiting or self._may_free(), "a fetch waits with nothing in flight to free room"


class SimWorker:
    """One TP rank: slot table, host tier, copy stream, counters; every residency change goes to ``push``."""

    def __init__(self, replica: str, rank: int, slots: int, loop: Loop, calibration: Calibration,
                 keys: Mapping[str, AdapterKey], nbytes: Mapping[str, int], host: SimHostTier, max_batch: int,
                 push: Callable[[Delta], None], on_load: Callable[[LoadRecord], None]) -> None:
        self.replica, self.rank = replica, rank
        self.loop, self.calibration, self.keys, self.nbytes, self.host = loop, calibration, keys, nbytes, host
        self.max_batch, self.push, self.on_load = max_batch, push, on_load
        self.table = SlotTable(slots)
        self.counters = CacheCounters()
        self._loads: dict[int, SimLoad] = {}  # slot -> its load (LOADING or READY)
        self._pending: dict[AdapterKey, SimLoad] = {}  # staging on the host, no slot yet
        self._waiters: list[SimLoad] = []  # staged, waiting for a load to finish to free a slot
        self.pins = SimPins(self.table, self._loads, keys, max_batch)  # the engine's pins on READY slots (step 9)
        self._copy_free = -math.inf  # when the copy stream is idle (free from the start, before t=0 too)
        self.copies: CopyClock | None = None  # pipelined: measured copies (``CopyClock``), set by the replica
        self._warm: OrderedDict[str, None] = OrderedDict()  # warm stages not started (``WarmQueue``), in order sent
        self._warm_reading = False  # a warm read in flight (one at a time)
        self._warm_wake = math.inf  # when a look at the warm queue is scheduled (inf: none)
        host.on_change = lambda key, present: self._changed(key, "staged" if present else "unstaged")

    # -- state --------------------------------------------------------------------------------------
    def preload(self, names: Sequence[str]) -> None:
        """The oracle: every adapter READY before t=0 (no load, no counter)."""
        for name in names:
            index, evicted = self.table.reserve(self.keys[name])
            assert evicted is None, "preload needs a slot per adapter"
            self.table.mark_ready(index)
            load = self._loads[index] = SimLoad(self.keys[name], self.nbytes[name], 0.0, prefetched=False)
            load.issued.fire(0.0)
            load.ready.fire(0.0)

    def is_ready(self, name: str) -> bool:
        slot = self.table.lookup(self.keys[name])
        return slot is not None and slot.state is SlotPhase.READY

    def describe(self) -> list[tuple[str, str, str, int]]:
        """The worker's full residency report (``WorkerActor.describe()['residency']``)."""
        return [(s.key.name, s.key.version, s.state.value, s.refs) for s in self.table.slots if s.key is not None]

    def hosted(self) -> list[tuple[str, str]]:
        """What its host tier holds whole (``WorkerActor.describe()['host']``)."""
        return [(k.name, k.version) for k, e in self.host.entries.items() if e.staged.done]

    def counts(self) -> dict[str, int]:
        """The integer counters of ``stats()`` (cheap: no latency summaries)."""
        host = {"host_hits": self.host.hits, "host_misses": self.host.misses, "host_waits": self.host.waits,
                "bytes_disk_to_host": self.host.bytes_read}
        return {k: host[k] if k in host else getattr(self.counters, k) for k in STATS_COUNTERS}

    def stats(self) -> dict[str, object]:
        """``WorkerCache.stats()``'s keys."""
        snap = self.counters.snapshot()
        snap.update(host_hits=self.host.hits, host_misses=self.host.misses, host_waits=self.host.waits,
                    bytes_disk_to_host=self.host.bytes_read,
                    slots_ready=self.table.count(SlotPhase.READY), slots_loading=self.table.count(SlotPhase.LOADING),
                    host_bytes_used=self.host.used, **resident_prefetches(self._loads.values()))
        return snap

    # -- control: commands (step 4), prefetch / evict ------------------------------------------------
    def apply(self, commands: Sequence[Command]) -> None:
        """``CommandGate.apply``: evicts, prefetches in priority order, stages (their changes push deltas)."""
        for command in commands:
            if isinstance(command, Evict):
                if not self.evict(command.adapter):
                    self._restate(self.keys[command.adapter])
            elif isinstance(command, Stage) and command.speculative:
                if command.adapter not in self._warm:
                    self._warm[command.adapter] = None
                self._pump_warm()
            elif isinstance(command, Stage):
                self.stage(command.adapter)
            else:
                self.prefetch(command.adapter)

    def _pump_warm(self) -> None:
        """``WarmQueue``: start the next warm stage if no other read is in flight or waiting, one at a time;
        else look again when the reads in flight end."""
        while self._warm and not self._warm_reading:
            now = self.loop.now
            if self.host.read_ends(now) or self.host.waiting():
                ends = [end for end in self.host.read_ends(now) if end < math.inf]  # a store read's end is unknown
                wake = min(ends) if ends else now + 0.01
                if wake < self._warm_wake or self._warm_wake <= now:
                    self._warm_wake = wake
                    self.loop.at(wake, self._pump_warm)
                return
            name, _ = self._warm.popitem(last=False)
            if name in self.keys and self.stage(name):
                self._warm_reading = True
                self.host.entries[self.keys[name]].staged.then(lambda _: self._warm_done())

    def _warm_done(self) -> None:
        self._warm_reading = False
        self._pump_warm()

    def _restate(self, key: AdapterKey) -> None:
        """``WorkerCache.restate``: the state of a held adapter again (nothing if absent)."""
        slot = self.table.lookup(key)
        if slot is not None:
            self._changed(key, "in_use" if slot.refs else slot.state.value)

    def _changed(self, key: AdapterKey, state: str, error: str = "", read_s: float = 0.0) -> None:
        """One residency change, reported at once (``WorkerCache.on_change``); ``read_s``: a READY's store read."""
        self.push((key.name, key.version, state, error, read_s))

    def prefetch(self, name: str, on_demand: bool = False) -> SimLoad:
        """Start loading ``name`` (idempotent): the load in flight or done, or a new one."""
        key = self.keys[name]
        slot = self.table.lookup(key)
        if slot is not None:
            return self._loads[slot.index]
        if key in self._pending:
            return self._pending[key]
        load = self._pending[key] = SimLoad(key, self.nbytes[name], self.loop.now, prefetched=not on_demand)
        self.counters.prefetches += not on_demand
        self.counters.demand_loads += on_demand
        try:
            entry, load.host_hit = self.host.fetch(key, load.nbytes, wait=True)
        except CapacityError:
            del self._pending[key]
            self._reject(load, "no host-tier room")
            return load
        entry.staged.then(functools.partial(self._staged, load, entry))
        return load

    def stage(self, name: str) -> bool:
        """``WorkerCache.stage``: read the shard into the host tier with no slot; whether a read started.
        Like the real one it never waits for room: no room (or loads waiting for it) is a stage failure."""
        key = self.keys[name]
        if self.table.lookup(key) is not None or key in self._pending:
            return False
        try:
            entry, hit = self.host.fetch(key, self.nbytes[name], count=False)
        except CapacityError:
            self.counters.stage_failures += 1
            return False
        self.counters.stages += not hit
        entry.staged.then(lambda _: self.host.release(key))
        return not hit

    def evict(self, name: str) -> bool:
        """Free the adapter's slot if it is READY and idle; False if absent, loading or in use."""
        key = self.keys[name]
        slot = self.table.lookup(key)
        if slot is None or not self.table.evict(key):
            return False
        self._retire(self._loads.pop(slot.index))
        self._changed(key, "gone")
        return True

    # -- engine: hold (one adapter of acquire), release (step 9; its pins: ``pins``) --------------------------------
    def hold(self, name: str, first: bool) -> int | SimLoad:
        """A reference on ``name``'s slot (its index), or the load to wait for until it is issued.

        ``first``: the acquire's first look at this adapter (hits and misses are counted once)."""
        key = self.keys[name]
        slot = self.table.lookup(key)
        if slot is None:
            if first:
                self.counters.gpu_misses += 1
            load = self.prefetch(name, on_demand=True)  # the pending load, if one is in flight
            slot = self.table.lookup(key)  # a host-tier hit is placed at once
            if slot is None:
                if load.ready.done:
                    raise RuntimeError(f"{self.replica}/{self.rank}: on-demand load of {key} failed: no GPU slot or "
                                       "host-tier room (the real engine's acquire raises here too)")
                return load
        elif first:
            self.counters.gpu_hits += 1
        self.table.incref(slot.index)
        self._loads[slot.index].used = True
        return slot.index

    def loading(self, index: int) -> SimLoad | None:
        """The load of a held slot if it is still in flight (the compute stream waits for it)."""
        return self._loads[index] if self.table.slots[index].state is SlotPhase.LOADING else None

    def release(self, held: Sequence[int]) -> None:
        for index in held:
            self.table.decref(index)

    # -- the load path -----------------------------------------------------------------------------
    def _staged(self, load: SimLoad, entry: _Staged, staged: Signal) -> None:
        if not staged.ok:  # waited for host room that nothing in flight could free
            del self._pending[load.key]
            self._reject(load, "no host-tier room")
            return
        load.disk_ms = 0.0 if load.host_hit else entry.read_ms
        self._place(load)

    def _place(self, load: SimLoad) -> None:
        """Reserve a slot and issue the copy; if only loads in flight stand in the way, wait for one."""
        try:
            index, evicted = self.table.reserve(load.key)
        except CapacityError:
            if any(s.state is SlotPhase.LOADING and s.refs == 0 for s in self.table.slots):
                self._waiters.append(load)
                return
            del self._pending[load.key]
            self.host.release(load.key)
            self._reject(load, "no slot")
            return
        if evicted is not None:
            self._retire(self._loads.pop(index))
            self._changed(evicted, "gone")
        self._changed(load.key, "loading")
        load.slot = index
        self._loads[index] = self._pending.pop(load.key)
        now = self.loop.now
        start = max(now, self._copy_free)
        self._copy_free = start + self.calibration.h2d_s(load.nbytes)
        load.h2d_ms = (self._copy_free - start) * 1e3
        load.issued_s = now
        load.issued.fire(now)
        self.loop.at(self._copy_free + self.calibration.load_fixed_ms / 1e3, self._finish, load)

    def _finish(self, load: SimLoad) -> None:
        """The copy completed: READY (step 7), counters, the record; waiters try again."""
        now = self.loop.now
        self.table.mark_ready(load.slot)
        self._changed(load.key, "ready", read_s=load.disk_ms / 1e3)
        c = self.counters
        c.loads += 1
        c.bytes_host_to_gpu += load.nbytes
        if not load.host_hit:
            c.disk_ms.add(load.disk_ms)
        c.h2d_ms.add(load.h2d_ms)
        c.ready_ms.add((now - load.start_s) * 1e3)
        if self.copies is not None:  # the copy's time on the stream to READY, as the engine's events measure it
            self.copies.copied(load.nbytes, (load.h2d_ms + self.calibration.load_fixed_ms) / 1e3, now)
        self.host.release(load.key)
        self.on_load(LoadRecord(self.replica, self.rank, load.key.name, load.start_s, now, load.nbytes,
                                load.host_hit, load.disk_ms, load.h2d_ms, load.prefetched))
        load.ready.fire(now)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            self._place(waiter)

    def issued_copies(self) -> dict[str, tuple[int, float]]:
        """Adapters LOADING here (a slot taken: the read done, the copy issued) -> (bytes, when the copy was
        issued) (``WorkerCache.issued_copies``)."""
        return {s.key.name: (self._loads[s.index].nbytes, self._loads[s.index].issued_s) for s in self.table.slots
                if s.key is not None and s.state is SlotPhase.LOADING}

    def _reject(self, load: SimLoad, error: str) -> None:
        self.counters.load_failures += 1
        self._changed(load.key, "failed", error)
        load.issued.fire(self.loop.now, ok=False)
        load.ready.fire(self.loop.now, ok=False)

    def _retire(self, load: SimLoad) -> None:
        """A load's slot was freed: count it for prefetch accuracy."""
        self.counters.retired(load.prefetched, load.used)

    def check_integrity(self) -> None:
        self.table.check_integrity()
        for s in self.table.slots:
            assert (s.key is not None) == (s.index in self._loads), f"slot {s.index} and its load disagree"
        assert not set(self._pending) & {s.key for s in self.table.slots}, "a pending load already has a slot"
        self.host.check_integrity()
