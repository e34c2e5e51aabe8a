"""The load path of one TP rank (lifecycle steps 5-7): host-tier staging -> a slot -> chunked copies ->
READY -> its residency change.

``LoadPath`` starts loads (a prefetch, or an acquire that missed) and stages shards that get no slot. A
load takes its slot when its first chunk is on the host, waiting for one while only loads in flight hold
them; each staged chunk is copied on the copy stream after the slot's last use; the completion watcher
sees the last chunk's event complete and the slot becomes READY. A load that fails leaves the rank as it
was (its slot freed once no batch holds it, its host entry released).

``SlotBook`` (``workers/gpu/book.py``) is what the cache and its load path share under one lock. The cache
(``workers/cache.py``) composes both; nothing here imports it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Any

import torch

from lora_cache.adapters.chunks import ChunkPlan
from lora_cache.adapters.device_versions import host_readable
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shards import ShardLayout
from lora_cache.errors import CapacityError, SlotsBusyError
from lora_cache.vocab import AdapterKey, ReadinessRecord
from workers import faults
from workers.gpu.book import SlotBook
from workers.gpu.copies import H2D_FASTEST_BPS, CompletionWatcher, SlotLoad, WriteBack
from workers.gpu.slots import SlotPhase
from workers.gpu.streams import CpuStreams
from workers.kernels.meta import SlotMeta
from workers.staging.host_tier import HostEntry, HostTier

log = logging.getLogger(__name__)
WRITE_BACK_PIECES = 8  # a write-back is copied out in up to this many pieces, so that a load into the slot follows it
WRITE_BACK_PIECE_BYTES = 8 << 20  # ... of at least this many bytes each (a copy this size runs near the PCIe peak)


def write_back_pieces(nbytes: int) -> int:
    """How many pieces a write-back of a shard of ``nbytes`` is copied out in (the real and simulated workers')."""
    return max(1, min(WRITE_BACK_PIECES, nbytes // WRITE_BACK_PIECE_BYTES))


def write_back_ahead(vacating: Sequence[tuple[int, int, Any]], start: int, stop: int, element_size: int,
                     done: Callable[[Any], bool]) -> int:
    """The bytes the write-back stream has still to copy out, as of now, before a copy into the pool's elements
    ``start`` .. ``stop`` may copy its last chunk (``SlotBook.vacating``, under its lock); 0 if no write-back of that
    range is in flight. What ``workers.engine.admission.CopyClock`` counts a copy's landing from
    (``SlotLoad.behind``).

    The copy waits only for the pieces of the range it overwrites (``SlotLoad._vacated``). The pieces run on one
    stream in the order issued (``vacating``'s order: ``LoadPath.vacate``), so every piece issued before the
    last one it overwrites goes first, of whatever slot. Pieces already complete are not counted; one in flight
    counts whole (later than it can land, never sooner). Until 2026-11-30 (fourteenth session) the slot's whole
    copy out was counted: a rank-16 copy after a rank-64 write-back was charged four times its wait, and a
    write-back queued behind others was missed (a copy admitted as LOADING landed after its layer, in the
    simulator at 2 GB/s). Since issue 43 a range may overlap the write-backs of several evicted adapters' pages."""
    last = -1
    for i, (begin, end, event) in enumerate(vacating):
        if begin < stop and end > start and not done(event):
            last = i
    return sum((end - begin) * element_size for begin, end, event in vacating[: last + 1] if not done(event))


def _in_flight(book: SlotBook, key: AdapterKey) -> Future[ReadinessRecord] | None:
    """The future of ``key``'s load if it has a slot or a load on its way to one (caller holds the lock): a start of
    it again is that load (idempotent)."""
    slot = book.table.lookup(key)
    if slot is not None:
        return book.loads[slot.index].future
    pending = book.pending.get(key)
    return None if pending is None else pending.future


def _waited(load: SlotLoad, error: CapacityError) -> SlotsBusyError:
    """The error of an on-demand load that found every slot held (after its ``slot_wait_s``, if any)."""
    waited = f"waited {load.slot_wait_s:g} s (slot_wait_s) and " if load.slot_wait_s > 0 else ""
    return SlotsBusyError(f"{error}; this request's load {waited}found none let go: release finished batches "
                          "sooner, configure more slots, or raise slot_wait_s")


class LoadPath:
    """Loads into one rank's slot ``pool``: staged through ``host``, copied on ``streams``' copy stream with
    each slot's kernel metadata (``meta``), READY (and ``on_ready``) once the last chunk's copy completed."""

    def __init__(self, book: SlotBook, host: HostTier, streams: CpuStreams, pool: torch.Tensor, meta: SlotMeta,
                 tp_rank: int, on_ready: Callable[[ReadinessRecord], None] | None,
                 registered: Callable[[str], bool] = lambda name: True, page_numel: int | None = None) -> None:
        """``pool``: the kernels' view, ``[num_slots, pool elements]`` with a row stride of 0 (every row is the
        whole pool: a slot's offsets are the pool's, ``WorkerCache``); ``page_numel``: the elements of a page
        (default: the pool over its pages, ``book.table.num_pages``). ``registered(name)``: whether the adapter is
        still in the catalog (an evicted shard of an unregistered one is not written back: exclusive tiers,
        ``HostTierConfig.tiers``)."""
        self.book, self.host, self.streams, self.pool, self.meta = book, host, streams, pool, meta
        self.flat = pool[0]  # the pool's elements, pages one after another
        self.page_numel = page_numel or self.flat.numel() // book.table.num_pages
        self.tp_rank, self.on_ready, self.registered = tp_rank, on_ready, registered
        self.exclusive = host.config.tiers == "exclusive"
        # staged, waiting for a slot (book.lock): for a load in flight to finish, or (on demand) for a batch to let go
        self.slot_waiters: list[tuple[SlotLoad, HostEntry | None]] = []
        book.on_room = self._retry_waiters
        self.watcher = CompletionWatcher(streams, self._finish)

    def start(self, spec: AdapterSpec, key: AdapterKey, layout: ShardLayout, plan: ChunkPlan,
              on_demand: bool, slot_wait_s: float = 0.0, commanded: bool = False) -> Future[ReadinessRecord]:
        """Load ``key`` unless it has a slot or a load already (idempotent); its future (``WorkerCache.prefetch``)."""
        book = self.book
        with book.lock:
            if (already := _in_flight(book, key)) is not None:
                return already
            host_readable(spec)  # a device push's version loads from its image only (``load_image``)
            load = SlotLoad(key, layout, plan, prefetched=not on_demand, slot_wait_s=slot_wait_s if on_demand else 0.0,
                            commanded=commanded, store=spec.store)
            book.pending[key] = load
            book.counters.prefetches += not on_demand
            book.counters.demand_loads += on_demand
        try:
            staged, load.host_hit = self.host.fetch(spec, layout, chunks=load.plan.entry_spans,
                                                    on_chunk=functools.partial(self._chunk_staged, load), wait=True)
        except Exception as e:  # e.g. a shard larger than the host tier, or a full tier with nothing in flight
            self._fail(load, e)
            return load.future
        staged.add_done_callback(functools.partial(self._read_done, load))
        return load.future

    def start_image(self, key: AdapterKey, layout: ShardLayout, plan: ChunkPlan, shard: Any,
                    commanded: bool = False, settle_s: float = 0.0) -> Future[ReadinessRecord]:
        """Load ``key`` from a pushed image on the device (``shard``: ``workers.reads.device.ImageShard``) unless it
        has a slot or a load already (idempotent, as ``start``): no host tier, no read; a slot as any load's, then
        one gather into it on the copy stream after the slot's last use and the trainer's event, and READY once
        its event completed and its finite flag is read (``_finish``). ``settle_s``: where this call issued the
        gather, it waits up to that long for it and makes the load READY on this thread
        (``CompletionWatcher.settle``)."""
        book = self.book
        with book.lock:
            if (already := _in_flight(book, key)) is not None:
                return already
            load = SlotLoad(key, layout, plan, commanded=commanded, image=shard)
            load.marks[:0] = shard.marks or []  # its phases before the load (``WorkerCache.load_image``)
            shard.marks = load.marks
            book.pending[key] = load
            book.counters.prefetches += 1
            book.counters.image_loads += 1
        load.staged_chunks = len(plan.chunks)  # every byte is on the device already
        if load.claim():
            self._place(load, None)
            if settle_s > 0 and load.issued.is_set() and load.error is None and self.watcher.settle(load, settle_s):
                wait([load.future], timeout=1.0)  # delivered here, or by the watcher, which took it first
        return load.future

    def stage(self, spec: AdapterSpec, key: AdapterKey, layout: ShardLayout,
              plan: ChunkPlan) -> Future[HostEntry] | None:
        """Read ``key``'s shard into the host tier with no slot, never waiting for room (``WorkerCache.stage``)."""
        with self.book.lock:
            if self.book.table.lookup(key) is not None or key in self.book.pending:
                return None
        host_readable(spec)
        try:
            staged, hit = self.host.fetch(spec, layout, count=False, chunks=plan.entry_spans)
        except CapacityError:
            with self.book.lock:
                self.book.counters.stage_failures += 1
            return None
        with self.book.lock:
            self.book.counters.stages += not hit
        staged.add_done_callback(functools.partial(self._staged, key))
        return staged

    def _staged(self, key: AdapterKey, staged: Future[HostEntry]) -> None:
        if staged.exception() is None:
            self.host.release(key, staged.result())  # the entry read (it may have been dropped since)
        else:  # the tier dropped the entry and its references
            with self.book.lock:
                self.book.counters.stage_failures += 1

    def _chunk_staged(self, load: SlotLoad, entry: HostEntry, count: int, hit: bool) -> None:
        """``count`` chunks of the load's shard are on the host (reader thread, or the fetching one on a hit):
        the first takes a slot, each is copied as it lands (step 6)."""
        total = len(load.plan.chunks)
        staged = total if count >= entry.num_chunks else min(count, total)  # an entry read in other chunks
        load.host_hit = hit
        if staged == total and not hit:
            load.disk_ms = (time.perf_counter() - load.t0) * 1e3
        load.entry = entry
        load.staged(staged)
        if load.claim():
            faults.hit("before_copy", load.key)  # a test may stop (or kill) the worker here
            # the arena may still be pinning in the background (start-up): the copies wait for it, not the caller
            self.host.arena.when_pinned(functools.partial(self._place, load, entry))

    def _read_done(self, load: SlotLoad, staged: Future[HostEntry]) -> None:
        """The read ended (reader thread): nothing to do if it succeeded (its chunks went their way)."""
        error = staged.exception()
        if error is None or load.error is not None:  # succeeded, or rejected for want of a slot (_reject_staged)
            return
        load.fail(error)
        with self.book.lock:
            waiting = next((w for w in self.slot_waiters if w[0] is load), None)
            if waiting is not None:
                self.slot_waiters.remove(waiting)
            if load.slot >= 0:
                self._abandon(load, error)
            else:
                self._drop(load, error)
        if load.entry is not None:  # chunks were staged: let the copies issued from them finish first
            for event in load.events:
                self.streams.host_wait(event)
            self.host.release_failed(load.entry)
        if load.slot >= 0:
            self.book.report()
            load.future.set_exception(error)
        else:
            self._reject(load, error)

    def _abandon(self, load: SlotLoad, error: BaseException) -> None:
        """A load that failed after it took its slot (caller holds the lock): the slot frees once no
        batch holds it (its chunk waiters raise ``LoadFailed``)."""
        book = self.book
        book.counters.load_failures += 1
        book.changed(load.key, "failed", error=str(error))
        if book.table.slots[load.slot].refs == 0:
            book.free_failed(load.slot)
        else:
            book.broken.add(load.slot)

    def _place(self, load: SlotLoad, entry: HostEntry | None) -> None:
        """Reserve a slot and copy the staged chunks (``entry`` None: a pushed image's, ``start_image``); if only
        loads in flight or a fence (``SlotTable.fence``) stand in the way, wait for one to finish or the fence to
        lift."""
        book = self.book
        vacate: tuple[tuple[int, int, Any], ...] = ()
        load.mark("place")
        with book.lock:
            if load.error is not None:  # its read failed first: _read_done dropped it
                return
            try:
                load.slot, evicted = book.table.reserve(load.key, self.pages_for(load.layout.numel))
            except CapacityError as e:
                if (book.table.fenced or any(s.state is SlotPhase.LOADING and s.refs == 0 for s in book.table.slots)
                        or self._may_wait(load)):  # a fence lifts within an engine's round (``unfence``)
                    self.slot_waiters.append((load, entry))  # retried by _finish, or by a batch's release
                    return
                error: CapacityError | None = e
                if load.prefetched:  # no room ahead of need: counted apart from failed loads, not a command error
                    book.pending.pop(load.key, None)
                    book.counters.prefetch_no_room += 1
                    book.changed(load.key, "no_room", error=str(e))  # not there, and not a failed load
                else:  # a request's load: it waited slot_wait_s (or may not wait) for a batch to let go
                    error = _waited(load, e)
                    self._drop(load, error)
            else:
                error = None
                if load.wait_timer is not None:
                    load.wait_timer.cancel()
                for gone in evicted:  # oldest first, each copied out before this load's copies overwrite its pages
                    self.vacate(gone.slot)
                book.changed(load.key, "loading", acquired=not load.commanded)
                book.loads[load.slot] = book.pending.pop(load.key)
                load.base = book.table.slots[load.slot].first_page * self.page_numel
                after = book.after(load.slot)
                # the write-backs in flight of the pages it takes, to wait for, in its own coordinates (one that
                # failed midway left ranges it never copied into: the pieces stay until they complete)
                book.prune(self.streams.done)
                start, stop = load.base, load.base + load.layout.numel
                vacate = tuple((max(b, start) - start, min(e, stop) - start, event)
                               for b, e, event in book.vacating if b < stop and e > start)
                load.behind = write_back_ahead(book.vacating, start, stop, self.pool.element_size(), self.streams.done)
                load.mark("slot")
        if error is not None:  # failed once its read has ended: the tier holds the shard (a host hit next time)
            load.fail(error)
            if entry is None:
                self._reject(load, error)
            else:
                entry.ready.add_done_callback(functools.partial(self._reject_staged, load, entry, error))
            return None
        book.report()
        self.host.report()  # the host entries a write-back's room took
        load.mark("reported")
        write_meta = functools.partial(self._write_meta, load)
        src = load.image.fill if entry is None else entry.tensor
        load.place(self.streams, self.flat[load.base : load.base + load.layout.numel], src, after, write_meta,
                   self._issued, vacate)
        load.placed.set()

    def pages_for(self, numel: int) -> int:
        """The pages a shard of ``numel`` elements takes (a run of them: ``SlotTable.reserve``)."""
        return max(1, -(-numel // self.page_numel))

    def shard(self, slot: int) -> torch.Tensor:
        """The elements of the shard ``slot`` holds (caller holds the lock, or knows the slot stays put)."""
        load = self.book.loads[slot]
        return self.flat[load.base : load.base + load.layout.numel]

    def vacate(self, slot: int) -> None:
        """The slot table evicted ``slot``'s adapter (caller holds the lock): its load is retired, its "gone" queued,
        and under exclusive tiers its shard copied back into the host tier. The copy is issued now, on the write-back
        stream, in pieces with an event each (``book.vacating``), and every later copy into the slot (a new load's)
        waits for the pieces of the range it overwrites (``SlotLoad.place``'s ``vacate``); the host entry is the
        slot's own key, name@version, and is served only once the last piece's event completed (``HostTier.written``:
        the watcher). Nothing is written back for a tier that keeps host copies, or an unregistered adapter; a tier
        with no room for it, or one that holds it already, leaves it out (``HostTier.write_back``)."""
        gone = self.book.loads[slot]
        self.book.retire(slot)
        self.book.changed(gone.key, "gone")
        if not self.exclusive or not self.registered(gone.key.name):
            return
        numel, base = gone.layout.numel, gone.base
        size = max(1, -(-numel // write_back_pieces(gone.layout.nbytes)))
        pieces: list[tuple[int, int, Any]] = []

        def copy(dst: torch.Tensor) -> object:  # in pieces on the write-back stream, an event each
            try:
                for start in range(0, numel, size):
                    stop = min(numel, start + size)
                    pieces.append((base + start, base + stop, self.streams.copy_back(
                        dst[start:stop], self.flat[base + start : base + stop], label=("write-back", slot, start))))
            except BaseException:  # the tier frees ``dst``: no piece issued may still write it or read the slot
                if pieces:
                    self.streams.host_wait(pieces[-1][2])
                raise
            return pieces[-1][2]

        taken = self.host.write_back(gone.key, gone.layout, gone.plan.entry_spans, copy, gone.store)
        if taken is not None:
            entry, event = taken
            self.book.vacating.extend(pieces)  # the loads into these pages wait for them, range by range
            due = time.perf_counter() + gone.layout.nbytes / H2D_FASTEST_BPS
            self.watcher.add(WriteBack(gone.key, entry, event, due), self._written)

    def _written(self, write: WriteBack) -> None:
        self.host.written(write.entry)

    def _write_meta(self, load: SlotLoad, stream: object) -> None:
        """The slot's kernel metadata, queued after its first copy (marked for the probes' phase split)."""
        load.mark("meta")
        self.meta.write(load.slot, load.layout, None, stream, base=load.base)
        load.mark("meta end")

    def _reject_staged(self, load: SlotLoad, entry: HostEntry, error: BaseException, read: Future[HostEntry]) -> None:
        if read.exception() is None:
            self.host.release(load.key, entry)
        else:
            self.host.release_failed(entry)
        self._reject(load, error)

    def _issued(self, load: SlotLoad) -> None:
        """Every chunk's copy is issued: once the read has also ended (its counts taken), watch the last
        chunk's event (READY when it completes)."""
        load.issued.set()
        if load.entry is None:  # a pushed image's: no read to wait for
            self.watcher.add(load)
            return
        load.entry.ready.add_done_callback(lambda read: self.watcher.add(load) if read.exception() is None else None)

    def _retry_waiters(self) -> None:
        if not self.slot_waiters:  # no lock: a waiter appended later saw the room this call was for (book.lock)
            return
        with self.book.lock:
            waiters, self.slot_waiters = self.slot_waiters, []
        for load, entry in waiters:
            self._place(load, entry)

    def _may_wait(self, load: SlotLoad) -> bool:
        """Whether an on-demand ``load`` that found every slot held may wait for a batch to let go of one (caller
        holds the lock): until its ``slot_wait_s`` after it first found none, a timer failing it then."""
        if load.prefetched or load.slot_wait_s <= 0:
            return False
        now = time.monotonic()
        if load.wait_until is None:
            load.wait_until = now + load.slot_wait_s
            self.book.counters.slot_waits += 1
            load.wait_timer = threading.Timer(load.slot_wait_s, self._expire, (load,))
            load.wait_timer.daemon = True
            load.wait_timer.start()
        return now < load.wait_until

    def _expire(self, load: SlotLoad) -> None:
        """Its wait for a slot is over (timer thread): if it still waits, it fails (nothing else changes)."""
        with self.book.lock:
            waiting = next((w for w in self.slot_waiters if w[0] is load), None)
            if waiting is None:  # placed, failed or retrying meanwhile (a retry past the deadline fails itself)
                return
            self.slot_waiters.remove(waiting)
            error = _waited(load, SlotsBusyError(f"no GPU slot for {load.key}: all {len(self.book.table.slots)} "
                                                      "slots are loading or in use"))
            self._drop(load, error)
        load.fail(error)
        if waiting[1] is None:
            self._reject(load, error)
        else:
            waiting[1].ready.add_done_callback(functools.partial(self._reject_staged, load, waiting[1], error))

    def _finish(self, load: SlotLoad) -> None:
        """The copy's ready event completed (watcher thread): READY, report (step 7). A pushed image's shard is
        READY only if its finite flag says so; else its load fails and its slot frees."""
        load.mark("seen")
        if load.image is not None:
            try:
                load.image.check()
            except Exception as e:  # not finite: failed after it took its slot, as a failed read (``_abandon``)
                load.fail(e)
                with self.book.lock:
                    self._abandon(load, e)
                self.book.report()
                load.future.set_exception(e)
                self._retry_waiters()
                return
        record = ReadinessRecord(load.key.name, load.key.version, self.tp_rank, load.slot, load.disk_ms,
                                 self.streams.elapsed_ms(load.start_event, load.ready_event),
                                 (time.perf_counter() - load.t0) * 1e3, load.layout.nbytes, load.host_hit,
                                 bool(load.vacate), "" if load.host_hit or load.entry is None else load.entry.way)
        book = self.book
        if self.on_ready is not None:  # first: what a rank logs as READY precedes anything it reports. Once the
            try:  # lock below is released, another thread's report() may send this READY at once.
                self.on_ready(record)
            except Exception:  # a callback's failure is not the load's
                log.exception("readiness handler failed for %s", load.key)
        with book.lock:
            book.table.mark_ready(load.slot)
            book.prune(self.streams.done)  # every copy into its pages completed, after the write-backs over them
            book.counters.loads += 1
            if load.image is not None:
                book.counters.bytes_from_images += record.nbytes
            else:
                book.counters.bytes_host_to_gpu += record.nbytes
                if not record.host_hit:
                    book.counters.disk_ms.add(record.disk_ms)
            book.counters.h2d_ms.add(record.h2d_ms)
            book.counters.ready_ms.add(record.ready_ms)
            book.changed(load.key, "ready", record, acquired=not load.commanded)
        if load.entry is not None:
            self.host.release(load.key, load.entry)
        if self.exclusive:  # the slot holds the shard now: its host copy goes (written back when the slot is evicted)
            self.host.drop(load.key)
        book.report()
        load.mark("ready")
        load.future.set_result(record)
        self._retry_waiters()

    def _fail(self, load: SlotLoad, error: BaseException) -> None:
        with self.book.lock:
            self._drop(load, error)
        self._reject(load, error)

    def _drop(self, load: SlotLoad, error: BaseException) -> None:
        """Give up a load that has no slot (caller holds the lock, so its "failed" is queued before the
        changes of a new load of the adapter, which may start as soon as the lock is released)."""
        self.book.pending.pop(load.key, None)
        self.book.counters.load_failures += 1
        self.book.changed(load.key, "failed", error=str(error))

    def _reject(self, load: SlotLoad, error: BaseException) -> None:
        """A dropped load: report it, then wake its waiters."""
        self.book.report()
        load.fail(error)
        load.future.set_exception(error)
        load.placed.set()

    def close(self) -> None:
        self.host.cancel_waits()  # loads waiting for host room fail (holding nothing), before the watcher stops
        self.watcher.close()  # every issued copy done before the host arena is unpinned
        self.host.close()
