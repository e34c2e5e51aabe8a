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
  evicts, then "loading" when a load takes a slot, "ready", "gone" for ``evict``, "no_room" for a
  prefetch that found no GPU room (counted apart, not a failure), "failed" for a request's load that found
  none, or no host-tier room with nothing in flight to free it;
- ``apply`` is ``CommandGate.apply``: evicts, then prefetches; an evict refused because the adapter is
  loading or in use reports its state again (``WorkerCache.restate``: "in_use" if a batch holds it).
  A simulated command always names a known adapter, so no prefetch is refused.

The host tier is counted in bytes (unreferenced staged shards let go of in ``workers.staging.eviction``'s
order); the real arena's fragmentation is not modelled. Every rank of a replica holds shards of one size
(TP splits are even).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from bench.sim.calibration import Calibration
from bench.sim.events import Loop, Signal
from bench.sim.host_tier import SimHostTier, SimWarmQueue, _Staged
from bench.sim.pins import SimPins
from lora_cache.errors import CapacityError
from lora_cache.vocab import AdapterKey, Command, Evict, Ranking, Stage
from workers.counters import STATS_COUNTERS, CacheCounters, host_counts, resident_prefetches
from workers.engine.admission import CopyClock
from workers.gpu.loads import write_back_pieces
from workers.gpu.slots import SlotPhase, SlotTable

# (adapter, version, loading|ready|gone|failed, error, read_s): what the controller takes (read_s: a READY's store read)
Delta = tuple[str, str, str, str, float, bool]


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
    after_write_back: bool = False  # its copy followed a write-back of the slot (exclusive tiers)

    def as_log(self) -> dict[str, object]:
        """The fields ``fit_calibration`` reads (those of ``workers.gpu.copies.ReadinessRecord``, and the real
        load log's READY time ``t_s``, replica and rank)."""
        return {"nbytes": self.nbytes, "ready_ms": (self.ready_s - self.start_s) * 1e3, "h2d_ms": self.h2d_ms,
                "disk_ms": self.disk_ms, "host_hit": self.host_hit, "t_s": self.ready_s, "replica": self.replica,
                "rank": self.rank, "after_write_back": self.after_write_back}


@dataclass(eq=False)
class SimLoad:
    """One adapter's load on one rank: staged on the host, then copied into ``slot``."""

    key: AdapterKey
    nbytes: int
    start_s: float
    prefetched: bool
    commanded: bool = False  # started by a controller's command, not by the rank's own engine (``Delta.acquired``)
    issued: Signal = field(default_factory=Signal)  # a slot is reserved and the copy issued (or the load failed)
    ready: Signal = field(default_factory=Signal)  # READY (ok) or failed
    host_hit: bool = False
    slot: int = -1
    disk_ms: float = 0.0
    h2d_ms: float = 0.0
    issued_s: float = 0.0  # when its copy was issued (queued on the rank's copy stream)
    after_write_back: bool = False  # its copy followed the slot's write-back (``_vacating``)
    behind: int = 0  # write-back bytes ahead of its range when it took its slot (``SlotLoad.behind``)
    used: bool = False  # some batch acquired (or pinned) it: prefetch accuracy
    pages: range = range(0)  # the run of the pool's pages its slot holds (a paged pool)


class SimWorker:
    """One TP rank: slot table, host tier, copy stream, counters; every residency change goes to ``push``."""

    def __init__(self, replica: str, rank: int, slots: int, loop: Loop, calibration: Calibration,
                 keys: Mapping[str, AdapterKey], nbytes: Mapping[str, int], host: SimHostTier, max_batch: int,
                 push: Callable[[Delta], None], on_load: Callable[[LoadRecord], None], pages: int | None = None,
                 page_bytes: int | None = None) -> None:
        """``pages`` / ``page_bytes``: a paged pool (issue 43; ``workers.cache.pool_pages``): a shard takes the run of
        whole pages its bytes need; None: slots of the largest rank, one page each."""
        self.replica, self.rank = replica, rank
        self.loop, self.calibration, self.keys, self.nbytes, self.host = loop, calibration, keys, nbytes, host
        self.max_batch, self.push, self.on_load = max_batch, push, on_load
        self.table = SlotTable(slots, pages)
        self.page_bytes = page_bytes if pages is not None else None
        # a paged pool's write-backs in flight, issue order: (pages, start, end, bytes) (``SlotBook.vacating``)
        self._out: list[tuple[range, float, float, int]] = []
        self.counters = CacheCounters()
        self._loads: dict[int, SimLoad] = {}  # slot -> its load (LOADING or READY)
        self._pending: dict[AdapterKey, SimLoad] = {}  # staging on the host, no slot yet
        self._waiters: list[SimLoad] = []  # staged, waiting for a load to finish to free a slot
        self.pins = SimPins(self.table, self._loads, keys, max_batch)  # the engine's pins on READY slots (step 9)
        self._copy_free = -math.inf  # when the copy stream is idle (free from the start, before t=0 too)
        self._back_free = -math.inf  # when the write-back stream is idle (exclusive tiers)
        # slot -> its write-back's (start, end, pieces, bytes)
        self._vacating: dict[int, Vacating] = {}
        self.copies: CopyClock | None = None  # pipelined: measured copies (``CopyClock``), set by the replica
        self.warm = SimWarmQueue(loop, host, keys, functools.partial(self.stage, speculative=True))  # ``WarmQueue``
        host.on_change = lambda key, present: self._changed(key, "staged" if present else "unstaged")

    # -- state --------------------------------------------------------------------------------------
    def preload(self, names: Sequence[str]) -> None:
        """The oracle: every adapter READY before t=0 (no load, no counter)."""
        for name in names:
            index, evicted = self.table.reserve(self.keys[name], _pages(self.nbytes[name], self.page_bytes))
            assert not evicted, "preload needs a slot per adapter"
            self.table.mark_ready(index)
            load = self._loads[index] = SimLoad(self.keys[name], self.nbytes[name], 0.0, prefetched=False)
            load.issued.fire(0.0)
            load.ready.fire(0.0)

    def is_ready(self, name: str) -> bool:
        slot = self.table.lookup(self.keys[name])
        return slot is not None and slot.state is SlotPhase.READY

    def describe(self) -> list[tuple[str, str, str, int, bool]]:
        """The worker's full residency report (``WorkerActor.describe()['residency']``)."""
        return [(s.key.name, s.key.version, s.state.value, s.refs, not self._loads[s.index].commanded)
                for s in self.table.slots if s.key is not None]

    def hosted(self) -> list[tuple[str, str]]:
        """What its host tier holds whole (``WorkerActor.describe()['host']``)."""
        return [(k.name, k.version) for k, e in self.host.entries.items() if e.staged.done]

    def counts(self) -> dict[str, int]:
        """The integer counters of ``stats()`` (cheap: no latency summaries)."""
        host = host_counts(self.host)
        return {k: host[k] if k in host else getattr(self.counters, k) for k in STATS_COUNTERS}

    def stats(self) -> dict[str, object]:
        """``WorkerCache.stats()``'s keys."""
        snap = self.counters.snapshot()
        snap.update(host_counts(self.host))
        snap.update(slots_ready=self.table.count(SlotPhase.READY), slots_loading=self.table.count(SlotPhase.LOADING),
                    host_bytes_used=self.host.used, **resident_prefetches(self._loads.values()))
        return snap

    # -- control: commands (step 4), prefetch / evict ------------------------------------------------
    def apply(self, commands: Sequence[Command]) -> None:
        """``CommandGate.apply``: evicts, prefetches in priority order, stages (their changes push deltas)."""
        for command in commands:
            if isinstance(command, Evict):
                if not self.evict(command.adapter):
                    self._restate(self.keys[command.adapter])
            elif isinstance(command, Ranking):
                self.host.order.ranked(command.names)
            elif isinstance(command, Stage) and command.speculative:
                self.warm.add(command.adapter, command.disk)
            elif isinstance(command, Stage):
                self.stage(command.adapter)
            else:
                self.prefetch(command.adapter, commanded=True)

    def _restate(self, key: AdapterKey) -> None:
        """``WorkerCache.restate``: the state of a held adapter again (nothing if absent)."""
        slot = self.table.lookup(key)
        if slot is not None:
            self._changed(key, "in_use" if slot.refs else slot.state.value)

    def _changed(self, key: AdapterKey, state: str, error: str = "", read_s: float = 0.0,
                 acquired: bool = False) -> None:
        """One residency change, reported at once (``WorkerCache.on_change``); ``read_s``: a READY's store read;
        ``acquired``: a load an acquire started (``Delta.acquired``)."""
        self.push((key.name, key.version, state, error, read_s, acquired))

    def prefetch(self, name: str, on_demand: bool = False, commanded: bool = False) -> SimLoad:
        """Start loading ``name`` (idempotent): the load in flight or done, or a new one."""
        key = self.keys[name]
        slot = self.table.lookup(key)
        if slot is not None:
            return self._loads[slot.index]
        if key in self._pending:
            return self._pending[key]
        load = self._pending[key] = SimLoad(key, self.nbytes[name], self.loop.now, prefetched=not on_demand,
                                            commanded=commanded)
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

    def stage(self, name: str, speculative: bool = False) -> bool:
        """``WorkerCache.stage``: read the shard into the host tier with no slot; whether a read started.
        Like the real one it never waits for room: no room (or loads waiting for it) is a stage failure.
        ``speculative``: a warm stage's (``DemandMarks.speculative``: its read is no demand read for the node)."""
        key = self.keys[name]
        if self.table.lookup(key) is not None or key in self._pending:
            return False
        try:
            entry, hit = self.host.fetch(key, self.nbytes[name], count=False, speculative=speculative)
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
        self._write_back(key, slot.index)
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
            index, evicted = self.table.reserve(load.key, _pages(load.nbytes, self.page_bytes))
        except CapacityError:
            if any(s.state is SlotPhase.LOADING and s.refs == 0 for s in self.table.slots):
                self._waiters.append(load)
                return
            del self._pending[load.key]
            self.host.release(load.key)
            self._reject(load, "no slot", no_room=load.prefetched)
            return
        for gone in evicted:  # slots of the max rank: the slot it takes, if any; a paged pool: any, oldest first
            assert self.page_bytes is not None or gone.slot == index, "slots of the max rank are one page each"
            self._write_back(gone.key, gone.slot)  # its copy out, which this load's copy in follows piece by piece
            self._retire(self._loads.pop(gone.slot))
            self._changed(gone.key, "gone")
        self._changed(load.key, "loading", acquired=not load.commanded)
        load.slot = index
        load.pages = self.table.slots[index].page_range
        self._loads[index] = self._pending.pop(load.key)
        now = self.loop.now
        start = max(now, self._copy_free)
        copy_s = self.calibration.h2d_s(load.nbytes)
        end = start + copy_s
        if self.page_bytes is not None:
            start, end = _after_paged_write_backs(self._out, load, start, end, copy_s, now)
        elif index in self._vacating:  # ``SlotLoad.place``'s ``vacate``: each range after the piece that copies it out
            out_start, out_end, pieces, _ = self._vacating[index]
            load.after_write_back = True
            load.behind = _write_back_ahead(self._vacating, index, load.nbytes, now)
            start = max(start, out_start + (out_end - out_start) / pieces)
            covered = out_start + (out_end - out_start) * _covering(self._vacating[index], load.nbytes) / pieces
            end = max(start + copy_s, covered + copy_s / pieces)
        self._copy_free = end
        load.h2d_ms = (self._copy_free - start) * 1e3
        load.issued_s = now
        load.issued.fire(now)
        self.loop.at(self._copy_free + self.calibration.load_fixed_ms / 1e3, self._finish, load)

    def _finish(self, load: SimLoad) -> None:
        """The copy completed: READY (step 7), counters, the record; waiters try again."""
        now = self.loop.now
        self.table.mark_ready(load.slot)
        self._vacating.pop(load.slot, None)
        self._out = [w for w in self._out if w[2] > now]  # a paged pool's write-backs that ended
        self._changed(load.key, "ready", read_s=load.disk_ms / 1e3, acquired=not load.commanded)
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
        if self.host.exclusive:  # ``LoadPath._finish``: the slot holds it now
            self.host.drop(load.key)
        self.on_load(LoadRecord(self.replica, self.rank, load.key.name, load.start_s, now, load.nbytes,
                                load.host_hit, load.disk_ms, load.h2d_ms, load.prefetched, load.after_write_back))
        load.ready.fire(now)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            self._place(waiter)

    def _write_back(self, key: AdapterKey, index: int) -> None:
        """``LoadPath.vacate``: exclusive tiers copy an evicted slot's shard back into the host tier, on the
        write-back stream (at the host-to-device rate: PCIe's two directions alike) in ``write_back_pieces`` pieces,
        which the next copy into the slot follows (``_place``)."""
        if not self.host.exclusive:
            return
        nbytes = self.nbytes[key.name]
        start = max(self.loop.now, self._back_free)
        end = start + self.calibration.h2d_s(nbytes)
        if self.host.write_back(key, nbytes, end):
            self._back_free = end
            if self.page_bytes is not None:
                self._out.append((self._loads[index].pages, start, end, nbytes))
            else:
                self._vacating[index] = (start, end, write_back_pieces(nbytes), nbytes)

    def issued_copies(self) -> dict[str, tuple[int, float, int]]:
        """Adapters LOADING here (a slot taken: the read done, the copy issued) -> (bytes, when the copy was
        issued, the write-back bytes ahead of its range when it took its slot: ``SimLoad.behind``)
        (``WorkerCache.issued_copies``)."""
        return {s.key.name: (self._loads[s.index].nbytes, self._loads[s.index].issued_s, self._loads[s.index].behind)
                for s in self.table.slots if s.key is not None and s.state is SlotPhase.LOADING}

    def _reject(self, load: SimLoad, error: str, no_room: bool = False) -> None:
        """``no_room``: a prefetch found every slot held (as the worker's: counted apart, "no_room", no failure)."""
        if no_room:
            self.counters.prefetch_no_room += 1
        else:
            self.counters.load_failures += 1
        self._changed(load.key, "no_room" if no_room else "failed", error)
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
        if self.host.exclusive:  # a READY slot's shard has no idle host copy (``LoadPath._finish`` dropped it)
            held = self.host.entries
            both = [k for s in self.table.slots if s.state is SlotPhase.READY and (k := s.key) is not None
                    and k in held and held[k].staged.done and not held[k].refs]
            assert not both, f"{both} READY in a slot with an idle host copy (exclusive tiers)"
        self.host.check_integrity()


Vacating = tuple[float, float, int, int]  # a slot's write-back: (start, end, pieces, bytes), on the write-back stream


def _piece(out: Vacating) -> int:
    """The bytes of each piece of the write-back ``out`` (the last may be shorter)."""
    _, _, pieces, size = out
    return max(1, -(-size // pieces))


def _covering(out: Vacating, nbytes: int) -> int:
    """How many pieces of the write-back ``out`` a copy of ``nbytes`` into its slot waits for: those of the range it
    overwrites, up to the one that covers its last byte (``SlotLoad._vacated``)."""
    return min(out[2], max(1, -(-nbytes // _piece(out))))


def _write_back_ahead(vacating: dict[int, Vacating], index: int, nbytes: int, now: float) -> int:
    """``workers.gpu.loads.write_back_ahead``: the bytes the write-back stream still has to copy out, as of ``now``,
    before a copy of ``nbytes`` into slot ``index`` may copy its last chunk (pieces complete not counted, one in
    flight whole); 0 if none of the slot's pieces is still to come."""
    if index not in vacating or vacating[index][1] <= now:
        return 0
    mine = vacating[index][0]
    total = 0
    for slot, out in vacating.items():
        start, end, pieces, size = out
        if start > mine or end <= now:
            continue  # the stream runs them in the order issued: one issued after it does not hold it
        piece = _piece(out)
        upto = _covering(out, nbytes) if slot == index else pieces
        total += sum(min(piece, size - j * piece) for j in range(upto)
                     if start + (end - start) * (j + 1) / pieces > now)
    return total


def _pages(nbytes: int, page_bytes: int | None) -> int:
    """The pages a shard of ``nbytes`` takes (``LoadPath.pages_for``): one per slot of the max rank (no pages)."""
    return 1 if page_bytes is None else max(1, -(-nbytes // page_bytes))


def _after_paged_write_backs(out: list[tuple[range, float, float, int]], load: SimLoad, start: float, end: float,
                             copy_s: float, now: float) -> tuple[float, float]:
    """A paged pool (``LoadPath._place``): the copy into ``load``'s pages follows the write-backs in flight over
    any of them (``out``, issue order), whoever held them: it starts after the first one's first piece and ends no
    sooner than a piece's copy after the last one (the pieces of a range, as on one slot); ``behind`` counts the
    write-back bytes issued up to the last one over its pages (``write_back_ahead``)."""
    pages = load.pages
    over = [i for i, w in enumerate(out) if w[2] > now and w[0].start < pages.stop and pages.start < w[0].stop]
    if not over:
        return start, end
    load.after_write_back = True
    load.behind = sum(w[3] for w in out[: over[-1] + 1] if w[2] > now)
    first, last = out[over[0]], out[over[-1]]
    start = max(start, first[1] + (first[2] - first[1]) / write_back_pieces(first[3]))
    return start, max(start + copy_s, last[2] + copy_s / write_back_pieces(load.nbytes))
