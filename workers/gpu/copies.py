"""Slot loads in flight and the completion watcher that turns finished copies into readiness records.

Lifecycle step 6: a load is issued as layer-ordered chunks (``lora_cache.adapters.chunks``), each chunk's copy as
soon as it is staged on the host and the load has a slot (``SlotLoad.staged`` / ``place``), with an
event per chunk; its ``ready_event`` is the last chunk's. Lifecycle step 7: a slot becomes READY only
when every chunk's copy has completed (the last event: one copy stream runs them in order); the watcher
polls events (``query()``, never a blocking sync) on its own thread and hands each finished load back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from lora_cache.adapters.chunks import ChunkPlan
from lora_cache.adapters.objects import StoreSource
from lora_cache.adapters.shards import ShardLayout
from lora_cache.vocab import AdapterKey, ReadinessRecord
from workers.gpu.streams import CpuStreams

log = logging.getLogger(__name__)
COPY_MAX_BYTES = 64 << 20  # staged chunks copied together, at most (a copy of >= 4 MB runs at the pinned peak)
H2D_FASTEST_BPS = 64e9  # above any pinned host -> GPU copy measured (53-55 GB/s, PCIe Gen5 x16): never late
GATHER_FASTEST_BPS = 2.5e12  # above a device-to-device gather's bytes per second (it reads and writes each: ~1.3
# TB/s measured on an H100, 4.8 TB/s of HBM on an H200 halved): a pushed image's read is never seen late


def host_copy_ms(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Median ms of a plain pinned-host -> ``device`` copy of ``nbytes`` (a memcpy on the CPU): the reference a
    shard's load or a push is measured against, in the same process and run (``WorkerActor.copy_probe``,
    ``bench.probes.push_floor``)."""
    cuda = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


class LoadFailed(RuntimeError):
    """Raised to a waiter on a chunk of a load that failed; ``__cause__`` is the load's own error."""


@dataclass(eq=False)
class SlotLoad:
    """One adapter's load: staged on the host chunk by chunk, each chunk copied into ``slot`` once both it
    is staged and the load has a slot (in chunk order, on one copy stream)."""

    key: AdapterKey
    layout: ShardLayout
    plan: ChunkPlan
    t0: float = field(default_factory=time.perf_counter)
    future: Future[ReadinessRecord] = field(default_factory=Future)
    issued: threading.Event = field(default_factory=threading.Event)  # set once every copy is issued, or failed
    placed: threading.Event = field(default_factory=threading.Event)  # set once it has a slot, or failed
    slot: int = -1
    host_hit: bool = False
    disk_ms: float = 0.0
    start_event: Any = None
    events: list[Any] = field(default_factory=list)  # one per chunk issued, in chunk order
    error: BaseException | None = None  # the load failed (chunks not issued yet never will be)
    prefetched: bool = True  # started ahead of need (prefetch), not by an acquire that missed
    store: StoreSource | None = None  # its object in a store, if any: an evicted write-back touches its disk copy
    commanded: bool = False  # started by a controller's command (``CommandGate``), not by the rank's own engine
    used: bool = False  # some batch acquired it (prefetch accuracy: used before eviction)
    staged_chunks: int = 0  # chunks on the host so far
    slot_wait_s: float = 0.0  # on demand: how long it may wait for a batch to let go of a slot (a request's lease)
    wait_until: float | None = None  # on demand, every slot held: when its wait for one ends (LoadPath._place)
    wait_timer: Any = None  # the timer that fails it then
    copy_due: float = 0.0  # perf_counter time before which the copies issued last cannot have completed
    _copy: tuple[Any, ...] | None = None  # (streams, dst, src, after, then, on_issued) once it has a slot
    _claimed: bool = False  # someone is placing it (takes its slot)
    entry: Any = None  # the host entry its chunks are copied from (once one is staged)
    vacate: tuple[tuple[int, int, Any], ...] = ()  # write-back pieces in flight over its range: (start, end, event)
    base: int = 0  # the pool element its shard starts at (its slot's first page)
    behind: int = 0  # bytes the write-back stream had to copy out, when it took its slot, before its range was out
    marks: list[tuple[str, float]] = field(default_factory=list)  # (phase, perf_counter) as it goes (probes)
    image: Any = None  # a pushed image's shard (``workers.reads.device.ImageShard``): the slot is filled by its one
    # gather on the device, not copied from the host; its bytes are served only once proven finite (READY)
    _cond: threading.Condition = field(default_factory=threading.Condition)  # protects the fields above it

    @property
    def ready_event(self) -> Any:
        """The last chunk's event (None until every chunk is issued): READY when it completes."""
        return self.events[-1] if len(self.events) == len(self.plan.chunks) else None

    def mark(self, phase: str) -> None:
        """Note when ``phase`` happened (``time.perf_counter``; one list append: cheap on the hot path)."""
        self.marks.append((phase, time.perf_counter()))

    def claim(self) -> bool:
        """True once: to the first caller, which then places the load."""
        with self._cond:
            first, self._claimed = not self._claimed, True
        return first

    def staged(self, count: int) -> None:
        """``count`` chunks are on the host (reader thread): copy those the slot may take now."""
        with self._cond:
            self.staged_chunks = max(self.staged_chunks, count)
            on_issued = self._pump()
        if on_issued is not None:
            on_issued(self)

    def place(self, streams: CpuStreams, dst: torch.Tensor, src: Any, after: tuple[Any, ...],
              then: Callable[[Any], None], on_issued: Callable[[SlotLoad], None],
              vacate: tuple[tuple[int, int, Any], ...] = ()) -> None:
        """The load has its slot's pages ``dst``: issue every chunk staged so far (``src``: the staged shard on the
        host, or a pushed image's ``fill``); the first waits for ``after``
        (the last use of every page it takes) and runs ``then`` (its kernel metadata) before its copy. ``on_issued``
        runs once, after the last chunk's copy is issued, outside this load's lock. ``vacate``: the write-backs in
        flight over its range (exclusive tiers), (start, end, event) of each piece in ``dst``'s elements, in issue
        order; each copy also waits for the last piece that overlaps the range it overwrites (the pieces complete
        in order, on one stream)."""
        with self._cond:
            self.vacate = vacate
            self._copy = (streams, dst, src, after, then, on_issued)
            done = self._pump()
        if done is not None:
            done(self)

    def _pump(self) -> Callable[[SlotLoad], None] | None:
        """Issue the staged chunks not yet copied (caller holds the lock); the ``on_issued`` callback if
        this issued the last one."""
        if self._copy is None or self.error is not None:
            return None
        streams, dst, src, after, then, on_issued = self._copy
        before, total = len(self.events), len(self.plan.chunks)
        issued = 0  # elements copied by this call
        while len(self.events) < min(self.staged_chunks, total):
            c = self.plan.chunks[len(self.events)]
            # the staged chunks after it join its copy, up to COPY_MAX_BYTES: a host-tier hit (every chunk
            # staged at once) is a few large copies, not one per 4 MB chunk; each chunk's event is its copy's.
            # A pushed image's shard (every chunk "staged" at once) is one fill of the whole shard: one gather.
            last = len(self.events)
            limit = self.layout.numel if self.image is not None else COPY_MAX_BYTES // src.element_size()
            while last + 1 < min(self.staged_chunks, total) and self.plan.chunks[last + 1].stop - c.start <= limit:
                last += 1
            stop = self.plan.chunks[last].stop
            first = c.seq == 0
            vacated = self._vacated(c.start, stop)
            waits = (*(after if first else ()), *(() if vacated is None else (vacated,)))
            part = src if self.image is not None else src[c.start : stop]  # an image's fill takes the whole shard
            start, event = streams.copy_chunk(dst[c.start : stop], part,
                                              waits[0] if len(waits) == 1 else waits or None, then if first else None,
                                              label=(self.slot, c.seq), timed=first)
            if first:
                self.start_event = start
            now = time.perf_counter()
            for k in range(len(self.events), last + 1):
                self.events.append(event)
                self.marks.append((f"issue {k}", now))
            issued += stop - c.start
            self._cond.notify_all()
        if issued:
            rate = H2D_FASTEST_BPS if self.image is None else GATHER_FASTEST_BPS
            self.copy_due = time.perf_counter() + issued * dst.element_size() / rate
        return on_issued if before < total == len(self.events) else None

    def _vacated(self, start: int, stop: int) -> Any:
        """The event after which the elements ``start`` .. ``stop`` of its range are copied out (None: no
        write-back over them): the last piece issued that overlaps them."""
        return next((event for begin, end, event in reversed(self.vacate) if begin < stop and end > start), None)

    def chunk_event(self, index: int) -> Any:
        """Chunk ``index``'s event, waiting on the host until its copy is issued (its bytes staged, the
        slot taken): never a wait for a copy, only for the read that precedes it. A pushed image's shard is proven
        finite only once its copy completed: a batch that holds it waits on the host for that (READY) first."""
        self._proven()
        with self._cond:
            while len(self.events) <= index and self.error is None:
                self._cond.wait()
            if len(self.events) <= index:
                raise LoadFailed(f"{self.key}: chunk {index} of {len(self.plan.chunks)} never reached its slot "
                                 f"({self.error})") from self.error
            return self.events[index]

    def last_event(self) -> Any:
        """The last chunk's event, once every chunk's copy is issued (the host waits for the read, never for
        a copy); raises ``LoadFailed`` if the load failed."""
        self.issued.wait()
        self._proven()
        if self.error is not None:
            raise LoadFailed(f"{self.key}: its load failed ({self.error})") from self.error
        return self.ready_event

    def _proven(self) -> None:
        """A pushed image's shard: wait on the host until it is READY or failed (its finite proof runs after its
        copy, not before as a host read's does), so no batch runs on bytes not proven; a no-op otherwise. Only a
        batch that asks for a version in the middle of its push waits (~0.1-1 ms)."""
        if self.image is not None:
            self.issued.wait()
            if self.error is None and self._copy is not None:
                self._copy[0].host_wait(self.ready_event)  # the CPU's deferred copy stream runs it here
            try:
                self.future.result()
            except BaseException as e:
                raise LoadFailed(f"{self.key}: its load failed ({e})") from e

    def fail(self, error: BaseException) -> None:
        """No further chunk will be issued: wake every waiter with the error."""
        with self._cond:
            self.error = self.error or error
            self._cond.notify_all()
        self.issued.set()


@dataclass(eq=False)
class WriteBack:
    """Exclusive tiers: a shard's device-to-host copy from the slot it is evicted from into its new host entry
    (``HostTier.write_back``), watched as a load's last copy is; the entry is served once ``ready_event`` completed."""

    key: AdapterKey
    entry: Any  # the host entry it fills
    ready_event: Any
    copy_due: float  # perf_counter time before which the copy cannot have completed

    def mark(self, phase: str) -> None:
        """No phases are kept for a write-back (``SlotLoad.mark``'s interface)."""


class CompletionWatcher:
    """Polls the ready events of issued copies; calls ``on_done(load)`` for each that completed (or the callback
    it was added with: a write-back's).

    Each wake-up takes the GIL from the engine's launching thread, so it polls little: it sleeps until the
    earliest moment a load's last copies could have completed (``SlotLoad.copy_due``: their bytes at a rate no
    copy reaches), then polls every ``elapsed / 32`` since the load was handed over, within ``poll_s`` and
    ``max_poll_s``: a load is seen READY within about 3% of its time (50 us at least), with a few wake-ups each.
    """

    def __init__(self, streams: CpuStreams, on_done: Callable[[SlotLoad], None], poll_s: float = 50e-6,
                 max_poll_s: float = 500e-6) -> None:
        self.streams, self.on_done, self.poll_s, self.max_poll_s = streams, on_done, poll_s, max_poll_s
        self._cond = threading.Condition()  # protects _pending and _closed
        # loads in flight (or write-backs), when each was handed over, and what to call once it completed
        self._pending: list[tuple[SlotLoad | WriteBack, float, Callable[[Any], None]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lora-ready-watcher", daemon=True)
        self._thread.start()

    def add(self, load: SlotLoad | WriteBack, on_done: Callable[[Any], None] | None = None) -> None:
        """Watch ``load``'s ready event; ``on_done`` (default: the watcher's) is called with it once it completed."""
        load.mark("watch")
        with self._cond:
            self._pending.append((load, time.perf_counter(), on_done or self.on_done))
            self._cond.notify()

    def _next_poll(self, now: float) -> float:
        """When to look again (caller holds the lock; something is pending)."""
        return min(max(load.copy_due, now + min(self.max_poll_s, max(self.poll_s, (now - since) / 32)))
                   for load, since, _ in self._pending)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed and not self._pending:
                    return
                done = [p for p in self._pending if self.streams.done(p[0].ready_event)]
                self._pending = [p for p in self._pending if p not in done]
            for load, _, then in done:
                self._deliver(load, then)
            with self._cond:
                if self._pending and not done:  # an add() wakes it early: the new load may be due sooner
                    self._cond.wait(max(0.0, self._next_poll(time.perf_counter()) - time.perf_counter()))

    def settle(self, load: SlotLoad, within_s: float) -> bool:
        """The caller's own thread polls ``load``'s ready event for up to ``within_s`` (the GIL let go between polls)
        and, once it completed, delivers the load itself unless this watcher took it first (then the watcher's
        delivery is under way): whether it completed in time. For a caller that waits for the load anyway (a device
        push's rank, ``WorkerCache.load_image``): its copy takes ~0.05 ms, and the watcher's next poll and the
        hand-over back to the caller cost ~0.3 ms in a worker actor (bench/reports/issue-44.md). Past ``within_s``
        the watcher delivers it as any other."""
        deadline = time.perf_counter() + within_s
        while not self.streams.done(load.ready_event):
            if time.perf_counter() > deadline:
                return False
            time.sleep(0)  # lets go of the GIL: the thread that issued copies may be this one's peers
        with self._cond:
            taken = next((p for p in self._pending if p[0] is load), None)
            if taken is not None:
                self._pending.remove(taken)
        if taken is not None:
            self._deliver(load, taken[2])
        return True

    def _deliver(self, load: SlotLoad | WriteBack, on_done: Callable[[Any], None]) -> None:
        try:
            on_done(load)
        except Exception:  # a broken readiness consumer must not stop later loads from becoming READY
            log.exception("readiness handler failed for %s", load.key)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
