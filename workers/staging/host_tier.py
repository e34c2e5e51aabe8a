"""The pinned host tier: packed shards staged in a bounded arena, single-flight reads; idle shards let go of in its
``eviction`` strategy's order (``workers.staging.eviction``: least recently used by default).

Reads are dispatched on a thread pool (blocking file I/O off the caller's thread) and run where the
config's ``reads`` strategy says (``workers.staging.tier_reads``): in reader processes that share the arena (a
GPU worker: no GIL shared with the engine that launches beside them), or on the threads themselves. Concurrent fetches
of one adapter share one read. An entry is pinned by references while a host-to-GPU copy may still read it.
A fetch that finds every byte held by references that will be dropped (loads in flight) may wait for room
(``wait``): it is admitted, in FIFO order, when one of them lets go of its entry.

A read fills its entry chunk by chunk (``lora_cache.adapters.chunks``: the entry's ``chunks``, ranges of the
layout's entries) and tells each fetcher's ``on_chunk`` how many chunks are in place as they land, so a
load copies the first chunk to the GPU while the last one is still being read.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lora_cache.adapters.objects import StoreSource
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shards import ShardLayout
from lora_cache.errors import CapacityError, ConfigError
from lora_cache.vocab import AdapterKey  # one name@version key for planner and workers
from workers.reads.shard import ask_ahead, drop_pages, is_cold  # drop_pages, is_cold: tests patch them here
from workers.staging.arena import ALIGN, Block, HostArena
from workers.staging.disk_tier import DiskTier
from workers.staging.eviction import EvictionOrder
from workers.staging.host_config import HostTierConfig
from workers.staging.host_entry import HostEntry, Wait, chunk_listener, unregistered  # HostEntry re-exported
from workers.staging.node_reads import DemandMarks, NodeReads
from workers.staging.read_ways import ColdReads
from workers.staging.tier_reads import ProcessReads, ThreadReads

log = logging.getLogger(__name__)
__all__ = ["HostEntry", "HostTier", "drop_pages"]


def local_copy(disk: DiskTier | None, spec: AdapterSpec,
               busy: Callable[[], bool] | None = None) -> contextlib.AbstractContextManager[AdapterSpec]:
    """What a read of ``spec`` reads: its own file, or for an adapter in an object store its proven copy on this
    node's ``disk`` tier, held while it is read. ``busy``: a warm stage's read, whose store fetch yields to demand
    reads while ``busy()`` (``DiskTier.held``)."""
    if spec.store is None:
        return contextlib.nullcontext(spec)
    if disk is None:
        raise ConfigError(f"adapter {spec.name} is in an object store ({spec.path}) but this host tier has no disk "
                          "tier to fetch it into; build it with HostTier(..., disk=DiskTier(...))")
    return disk.held(spec, busy)


def no_room(host_bytes: int, held: Sequence[HostEntry], key: AdapterKey, nbytes: int) -> CapacityError:
    """The error of a fetch that finds the tier's bytes ``held`` by loads in flight."""
    taken = sum(e.block.nbytes for e in held)
    return CapacityError(f"host tier ({host_bytes} bytes) cannot stage {key} ({nbytes} bytes): {taken} bytes are held "
                         "by loads in flight; raise host_bytes or load fewer adapters at once")


class HostTier:
    """Staged shards by adapter key. ``fetch`` takes a reference; ``release`` drops it."""

    def __init__(self, config: HostTierConfig, ranks_here: int = 1, disk: DiskTier | None = None,
                 node: NodeReads | None = None) -> None:
        """``ranks_here``: GPU ranks on this host, whose cores ``read_parallel`` 0 (auto) shares, and whose memory
        ``host_bytes`` 0 (auto) does. ``disk``: the local disk tier that adapters from an object store are read
        from (``workers.staging.disk_tier``). ``node``: where this rank marks its demand reads for the node's other
        ranks, whose warm stages wait for them (``workers.staging.node_reads``; default: the node's directory)."""
        self.config = config = config.sized(ranks_here)
        self.demand = DemandMarks(node, self.reading)  # its demand reads, marked for the node's other ranks
        self.ranks_here = max(1, ranks_here)  # GPU ranks on this host: they share its warm read rate
        self.disk = disk
        self.reads = config.reads_for(config.pin and torch.cuda.is_available())
        processes = self.reads == "process"
        self.parallel = config.readers(ranks_here, processes)  # reader threads per read
        self.split = config.splits(self.parallel) if processes else 1  # reader processes per read, at most
        self.arena = HostArena(config.host_bytes, config.pin, shared=processes, background=config.pin_background)
        if processes:
            self._reader: ThreadReads | ProcessReads = ProcessReads(
                self.arena, config.read_threads, config.verify, -(-self.parallel // self.split), self.split,
                self.parallel)
        else:
            self._reader = ThreadReads(self.arena, config.read_threads, config.verify, self.parallel)
        self._pool = ThreadPoolExecutor(config.read_threads, thread_name_prefix="lora-read")
        ahead = config.read_ahead or config.direct_reads == "auto"  # a cold file asked for whole, off the readers'
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="lora-ahead") if ahead else None  # threads (auto: a way)
        self.asked_ahead = 0  # reads whose file was asked for ahead (``read_ahead``)
        # ``drop_page_cache``: a read file's pages dropped after its entry is served, off its readers' threads (an 8B
        # rank-64 file's drop took 9-10 ms here, and held its load's READY that long when it ran in ``_read``)
        self._drops = ThreadPoolExecutor(1, thread_name_prefix="lora-drop") if config.drop_page_cache else None
        self.cold = ColdReads(self.reading)  # ``direct_reads`` auto: each cold read's way, as the tier's reads measured
        self._lock = threading.Lock()  # protects _entries, _orphans, _waiting, the counters and the arena
        self._entries: OrderedDict[AdapterKey, HostEntry] = OrderedDict()  # LRU order, oldest first
        self.order = EvictionOrder(config.host_bytes, config.eviction, config.recent_s)  # idle entries' order
        self._orphans: list[HostEntry] = []  # failed reads whose staged chunks loads may still be copying
        self._waiting: OrderedDict[AdapterKey, Wait] = OrderedDict()  # fetches waiting for room, FIFO
        self._closing = False  # no more waits (the tier is closing)
        self.hits = self.misses = self.bytes_read = self.waits = 0  # waits: fetches that waited for room
        self.written_back = 0  # shards taken back from a GPU slot (exclusive tiers: ``write_back``)
        # what the tier holds, as it changes: (key, True) once a read put a shard here whole, (key, False) when the
        # shard leaves (the LRU's room, ``drop``). Queued under ``_lock`` (in the order of the changes), handed to
        # ``on_change`` by ``_report`` once the lock is released, one thread at a time (the order is kept).
        self.on_change: Callable[[AdapterKey, bool], None] | None = None
        self._changes: deque[tuple[AdapterKey, bool]] = deque()
        self._reporting = threading.RLock()

    def fetch(self, spec: AdapterSpec, layout: ShardLayout, count: bool = True, chunks: Sequence[slice] = (),
              on_chunk: Callable[[HostEntry, int, bool], None] | None = None,
              wait: bool = False) -> tuple[Future[HostEntry], bool]:
        """The staged shard (a future: reads are asynchronous) and whether it was a host-tier hit.

        ``count``: a lookup for a GPU load, counted in ``hits``/``misses`` (a stage ahead of one is not).
        ``chunks``: how a new read splits the shard (ranges of ``layout.entries``; a read in flight or
        done keeps its own); ``on_chunk(entry, count, hit)``: told how many chunks are in place, at once
        for those staged already (a hit: all of them, before this returns) and from the reader as the
        others land.

        A miss with no room raises ``CapacityError``, unless ``wait`` and room will come: then it waits
        behind earlier waits (FIFO; counted in ``waits``) until references that are held now are dropped,
        and its read starts then. A miss that does not wait never takes room ahead of a waiting one. A shard
        larger than the whole tier, or a tier whose every byte is held with nothing in flight that could
        let go of it, raises at once either way."""
        key = AdapterKey(spec.name, spec.version)
        with self._lock:
            entry = self._entries.get(key)
            waiting = self._waiting.get(key)
            hit = entry is not None or waiting is not None  # staged, or a read in flight or waiting (single flight)
            if entry is not None:
                self._entries.move_to_end(key)
                entry.refs, entry.protected = entry.refs + 1, self.order.used_again(entry.protected)
                entry.touched = time.monotonic()
            elif waiting is not None:
                waiting.refs += 1
            else:
                entry, waiting = self._miss(spec, layout, tuple(chunks), wait)
                if entry is not None:
                    entry.speculative = self.demand.warm
                    entry.protected = self.order.admitted(key, entry.speculative)
                    entry.touched = time.monotonic()
            if on_chunk is None:  # told of no chunk: if the read fails, this fetcher never lets go (``_failed``)
                if entry is not None:
                    entry.blind += 1
                elif waiting is not None:
                    waiting.blind += 1
            self.hits += count and hit
            self.misses += count and not hit
            if waiting is not None and on_chunk is not None:  # told from the read, once it is admitted
                waiting.listeners.append(chunk_listener(on_chunk, hit))
        self.report()
        if waiting is not None:
            return waiting.ready, hit
        assert entry is not None
        if hit and entry.speculative and not self.demand.warm:
            self.demand.join(entry)  # a load joins a warm stage's read: the node's other ranks yield to it, it to none
        if on_chunk is not None:
            entry.listen(chunk_listener(on_chunk, hit))
        if not hit:
            self._dispatch(spec, entry)
        return entry.ready, hit

    def _dispatch(self, spec: AdapterSpec, entry: HostEntry) -> None:
        """Start a new entry's read: sent to idle reader processes from here where it can be (``ProcessReads.begin``),
        replies collected on the pool; else read on the pool. A demand read is marked for the node until it ends."""
        if not entry.speculative:
            self.demand.mark(entry)
        number = self.cold.dispatched()  # every read counts: one sent while another runs times neither
        # ``direct_reads`` or ``read_ahead`` (never both) for a file found cold, decided here for the whole read (every
        # part of a split read alike); auto's ``ahead`` way asks ahead as ``read_ahead`` does
        if (self.config.direct_reads != "off" or self.config.read_ahead) and spec.store is None and is_cold(spec):
            ahead = self.cold.send(spec, entry, number, self.config.direct_reads, self.config.read_ahead)
            if ahead and self._ahead is not None:
                with self._lock:
                    self.asked_ahead += 1
                self._ahead.submit(ask_ahead, spec)
        try:
            started = self._reader.begin(spec, entry) if spec.store is None else None
            self._pool.submit(self._read, spec, entry, started).add_done_callback(lambda _: self.demand.unmark(entry))
        except BaseException:
            self.demand.unmark(entry)
            raise

    def _miss(self, spec: AdapterSpec, layout: ShardLayout, chunks: tuple[slice, ...],
              wait: bool) -> tuple[HostEntry | None, Wait | None]:
        """A new entry for a miss (caller holds the lock), or its wait for room; CapacityError if neither."""
        key = AdapterKey(spec.name, spec.version)
        size = -(-layout.nbytes // ALIGN) * ALIGN
        if size > self.arena.capacity:
            raise CapacityError(f"host tier ({self.config.host_bytes} bytes) can never stage {key}: its shard "
                                f"({layout.nbytes} bytes) is larger than the whole tier; raise host_bytes to at "
                                f"least {size} bytes")
        block = None if self._waiting else self._allocate(layout.nbytes)  # no room taken ahead of a wait
        if block is not None:
            entry = HostEntry(key, layout, block, self.arena.view(block, layout.dtype, layout.numel), Future(),
                              refs=1, chunks=chunks, store=spec.store)
            self._entries[key] = entry
            return entry, None
        if not wait or self._closing or not (self._waiting or self._may_free()):
            raise no_room(self.config.host_bytes, (*self._entries.values(), *self._orphans), key, layout.nbytes)
        waiting = self._waiting[key] = Wait(spec, layout, chunks)
        self.waits += 1
        return None, waiting

    def release(self, key: AdapterKey, entry: HostEntry | None = None) -> None:
        """Let go of ``key``'s entry, or of ``entry`` (the one fetched: found so once ``drop_adapter`` dropped it)."""
        with self._lock:
            entry = entry if entry is not None else self._entries[key]
            assert entry.refs > 0, f"host entry {key} released more often than fetched"
            entry.refs -= 1
            admitted = self._admit()
        self._start(admitted)
        self.report()

    def release_failed(self, entry: HostEntry) -> None:
        """Drop a reference on an entry whose read failed, once no copy reads its staged chunks any more;
        the last one frees its block."""
        self.release(entry.key, entry)

    def drop(self, key: AdapterKey) -> bool:
        """Free an unreferenced, staged shard now (benchmarks: the next fetch reads the file again)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.refs or not entry.ready.done():
                return False
            self.arena.free(self._entries.pop(key).block)
            self._changes.append((key, False))
            admitted = self._admit()
        self._start(admitted)
        self.report()
        return True

    def drop_adapter(self, name: str) -> int:
        """Every version of unregistered ``name`` leaves the tier (``WorkerControl.unregister_adapter``); the bytes
        freed now. An idle shard is freed now; one read or copied from leaves the index now (a later fetch reads
        afresh) and its block once read and let go; a read in flight fails then, a wait for room now (NotFoundError)."""
        with self._lock:
            used = self.arena.used_bytes
            waits = [(k, self._waiting.pop(k)) for k in [k for k in self._waiting if k.name == name]]
            self.order.forget(name)
            for key in [k for k in self._entries if k.name == name]:
                entry = self._entries.pop(key)
                entry.dropped = True
                if entry.whole:
                    self._changes.append((key, False))
                if entry.refs or not entry.ready.done():
                    self._orphans.append(entry)
                else:
                    self.arena.free(entry.block)
            freed = used - self.arena.used_bytes
            admitted = self._admit()
        for key, waiting in waits:
            waiting.ready.set_exception(unregistered(key))
        self._start(admitted)
        self.report()
        return freed

    def write_back(self, key: AdapterKey, layout: ShardLayout, chunks: Sequence[slice],
                   copy: Callable[[torch.Tensor], Any],
                   store: StoreSource | None = None) -> tuple[HostEntry, Any] | None:
        """Exclusive tiers (``HostTierConfig.tiers``): take in the shard a GPU slot lets go of from the slot itself,
        no store read. ``copy(dst)`` issues the slot's device-to-host copy into the new entry and returns its event;
        it is issued under the tier's lock, and the caller issues it before anything can reuse the slot (it holds
        the slot book's lock; the next load's copies queue behind it on the one copy stream). The entry, and that
        event, or None with nothing changed: the tier holds or reads the key already, a fetch waits for room (a
        write-back never takes room ahead of a needed read), the arena is still being pinned (or failed to be),
        the room would not come from idle entries, or the copy could not be issued. Until ``written`` is told the
        copy completed the entry is not served (``contains``, chunks): a fetch meanwhile joins it as a read in
        flight. Its changes are reported by the caller's ``report`` once it holds no lock. ``store``: the adapter's
        object in a store, if any (its disk copy is touched when the entry is evicted)."""
        with self._lock:
            if (self._closing or key in self._entries or self._waiting or self.arena.pin_pending
                    or self.arena.pin_error):
                return None
            block = self._allocate(layout.nbytes)
            if block is None:
                return None
            entry = HostEntry(key, layout, block, self.arena.view(block, layout.dtype, layout.numel), Future(),
                              chunks=tuple(chunks), store=store)
            entry.checked = entry.num_chunks  # the slot's bytes were proven finite when they were read
            try:
                event = copy(entry.tensor)
            except Exception:
                log.exception("write-back of %s not issued; the shard leaves the GPU as before", key)
                self.arena.free(block)
                return None
            entry.protected, entry.touched = self.order.written_back(key), time.monotonic()
            self._entries[key] = entry
            self.written_back += 1
        return entry, event

    def written(self, entry: HostEntry) -> None:
        """A write-back's copy completed (the caller's watcher): the entry is served from now on, as a read that
        ended; an adapter unregistered meanwhile is freed instead (``drop_adapter``)."""
        with self._lock:
            dropped = entry.dropped
            if not dropped:
                entry.whole = True
                self._changes.append((entry.key, True))
        if dropped:
            self._failed(entry, unregistered(entry.key))
            return
        entry.progress(entry.num_chunks)  # tells fetchers that joined it meanwhile
        self.report()
        entry.ready.set_result(entry)
        self._wake()

    def reading(self) -> int:
        """Reads in flight or waiting for room: while any, a warm stage waits (``workers.staging.warming``)."""
        with self._lock:
            return len(self._waiting) + sum(not e.ready.done() for e in self._entries.values())

    def contains(self, key: AdapterKey) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.ready.done() and entry.ready.exception() is None

    def _allocate(self, nbytes: int) -> Block | None:
        """A block, evicting idle staged entries for it (``victim``'s order); None if not enough (lock held):
        then none is evicted unless their bytes would have been (first fit may still find them scattered)."""
        idle = sum(e.block.nbytes for e in self._entries.values() if e.refs == 0 and e.ready.done())
        if self.arena.capacity - self.arena.used_bytes + idle < nbytes:
            return None
        while (block := self.arena.alloc(nbytes)) is None:
            key = self.order.victim(self._entries.items(), lambda e: e.refs == 0 and e.ready.done(), time.monotonic())
            if key is None:
                return None
            gone = self._entries.pop(key)
            self.arena.free(gone.block)
            self.order.evicted(key, gone.block.nbytes)
            if gone.store is not None and self.disk is not None:  # it leaves this rank's memory: where the store
                self.disk.let_go(gone.store)  # is saturated its disk copy becomes the most recent (``DiskTier.let_go``)
            self._changes.append((key, False))
        return block

    def _may_free(self) -> bool:
        """Whether room may still come without a new fetch: an entry that is referenced (its references
        will be dropped) or still being read, or an orphan that loads still copy from (lock held)."""
        return bool(self._orphans) or any(e.refs or not e.ready.done() for e in self._entries.values())

    def _admit(self) -> tuple[list[tuple[AdapterSpec, HostEntry]], list[tuple[Wait, CapacityError]]]:
        """Give the room there is to waiting fetches, oldest first (lock held): the entries to read, and
        the waits that can never be admitted (nothing left that could free room). The head of the line
        waits for room rather than let later, smaller shards pass it (no starvation). Dropped entries read and let
        go of (and failed ones no copy reads any more) are freed first."""
        for gone in [o for o in self._orphans if not o.refs and o.ready.done()]:
            self._orphans = [o for o in self._orphans if o is not gone]
            self.arena.free(gone.block)
        started: list[tuple[AdapterSpec, HostEntry]] = []
        failed: list[tuple[Wait, CapacityError]] = []
        while self._waiting:
            key, waiting = next(iter(self._waiting.items()))
            block = self._allocate(waiting.layout.nbytes)
            if block is None and self._may_free():
                break
            del self._waiting[key]
            if block is None:
                failed.append((waiting, no_room(self.config.host_bytes, (*self._entries.values(), *self._orphans), key,
                                                waiting.layout.nbytes)))
                continue
            layout = waiting.layout
            entry = HostEntry(key, layout, block, self.arena.view(block, layout.dtype, layout.numel), waiting.ready,
                              refs=waiting.refs, chunks=waiting.chunks, listeners=waiting.listeners,
                              blind=waiting.blind, protected=self.order.admitted(key, False), store=waiting.spec.store,
                              touched=time.monotonic())
            self._entries[key] = entry
            started.append((waiting.spec, entry))
        return started, failed

    def _start(self, admitted: tuple[list[tuple[AdapterSpec, HostEntry]], list[tuple[Wait, CapacityError]]]) -> None:
        """Start the reads of admitted waits, fail those that never will be (lock not held: callbacks run)."""
        started, failed = admitted
        for spec, entry in started:
            self._dispatch(spec, entry)
        for waiting, error in failed:
            waiting.ready.set_exception(error)

    def _wake(self) -> None:
        """Admit waiting fetches if room came without a release (a read that ended unreferenced)."""
        with self._lock:
            admitted = self._admit() if self._waiting else ([], [])
        self._start(admitted)
        self.report()

    def cancel_waits(self) -> None:
        """Fail every fetch still waiting for room, and refuse new waits (the tier, or its cache, is closing).
        A waiting fetch holds no block: nothing else changes."""
        with self._lock:
            self._closing = True
            waiting, self._waiting = list(self._waiting.items()), OrderedDict()
        for key, w in waiting:
            w.ready.set_exception(CapacityError(f"the host tier closed while {key} waited for room; "
                                                "nothing was staged"))

    def _read(self, spec: AdapterSpec, entry: HostEntry, started: Callable[[], int] | None = None) -> None:
        """Read ``entry`` (on the pool), or finish the read ``started`` in the fetching thread (``_dispatch``)."""
        if started is None:
            entry.marks.append(("read", time.perf_counter()))
        t0 = next(t for name, t in entry.marks if name == "read")
        read = spec
        try:
            if started is not None:
                entry.bytes_read = started()
            else:
                busy = self.demand.yields(entry, lambda: self.reading() > self.config.read_threads) \
                    if entry.speculative else None
                with local_copy(self.disk, spec, busy) as read:  # a store's adapter: its copy on this disk
                    entry.bytes_read = self._reader.read(read, entry)
            entry.progress(entry.num_chunks)  # a reader that reports no chunks: all of them at once (proven finite)
        except BaseException as e:  # a failed read leaves the tier as it was, and tells every waiter
            self._failed(entry, e)
            return
        entry.read_ms = (time.perf_counter() - t0) * 1e3
        entry.marks.append(("read end", time.perf_counter()))
        with self._lock:
            self.bytes_read += entry.bytes_read
            dropped = entry.dropped  # its adapter unregistered while it was read: never served
            if not dropped:
                entry.whole = True
                self._changes.append((entry.key, True))  # before the result: no eviction of it can be queued ahead
        self.cold.ended(entry)  # auto: a read that ran alone is a rate of its way
        if dropped:
            self._failed(entry, unregistered(entry.key))
            return
        self.report()  # its "staged" reaches on_change before the result, as a slot's "ready" does its future
        entry.ready.set_result(entry)
        if self._drops is not None:  # after the result: a load's READY waits for its read's end, never for this
            self._drops.submit(drop_pages, read)
        self._wake()  # done: if nobody references it any more, its room is the LRU's (and the change is reported)

    def _failed(self, entry: HostEntry, error: BaseException) -> None:
        """``entry``'s read failed, or its adapter was unregistered while it was read (no reader writes into it any
        more): the tier as it was, every waiter told. Its block is freed now, or, if chunks of it may be on their way
        to a GPU, once each fetcher told of them lets go (``release_failed``)."""
        entry.forget()
        with self._lock:
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            entry.refs -= entry.blind  # fetchers told of no chunk have no copy to wait for: they never release
            assert entry.refs >= 0, f"host entry {entry.key} released more often than fetched"
            self._orphans = [o for o in self._orphans if o is not entry]
            if entry.staged and entry.refs:
                self._orphans.append(entry)
            else:
                self.arena.free(entry.block)
            admitted = self._admit()
        entry.ready.set_exception(error)
        self._start(admitted)
        self.report()

    def report(self) -> None:
        """Hand the queued changes of what the tier holds to ``on_change``, oldest first (lock not held; also a
        caller that held a lock meanwhile, e.g. around a write-back)."""
        with self._reporting:
            while True:
                with self._lock:
                    if not self._changes:
                        return
                    key, present = self._changes.popleft()
                if self.on_change is not None:
                    try:
                        self.on_change(key, present)
                    except Exception:  # a broken consumer must not break reads; the controller's resync repairs
                        log.exception("host tier change of %s not reported", key)

    def contents(self) -> list[AdapterKey]:
        """The shards staged here whole (read and not failed), oldest use first: a full report's host part."""
        with self._lock:
            return [k for k, e in self._entries.items() if e.ready.done() and e.ready.exception() is None]

    def close(self) -> None:
        self.cancel_waits()
        self._pool.shutdown(wait=True, cancel_futures=False)
        if self._ahead is not None:
            self._ahead.shutdown(wait=True, cancel_futures=True)
        if self._drops is not None:  # every read's pages are out before the tier is gone (a benchmark's next policy)
            self._drops.shutdown(wait=True, cancel_futures=False)
        self._reader.close()
        self.arena.close()

    def check_integrity(self) -> None:
        with self._lock:
            self.arena.check_integrity()
            self.order.check_integrity()
            held = [*self._entries.values(), *self._orphans]
            assert self.arena.used_bytes == sum(e.block.nbytes for e in held), \
                "arena blocks and host entries disagree"
            assert all(e.refs >= 0 for e in held), "negative host reference count"
            assert not any(e.dropped for e in self._entries.values()), "a dropped entry is still served"
            assert not set(self._waiting) & set(self._entries), "a waiting fetch already has an entry"
            assert all(w.refs > 0 for w in self._waiting.values()), "a waiting fetch nobody waits for"
            assert not self._waiting or self._entries or self._orphans, "a fetch waits with nothing that frees room"
            assert self.arena.used_bytes <= self.config.host_bytes
