"""The slot book of one TP rank (lifecycle steps 5-7): what its cache and its load path share under one lock.

The slot table (which adapter each slot holds, in which pages of the pool), the load in each slot, loads with no
slot yet, each page's last use, the write-backs in flight over the pool's pages, the counters, and the queue of
residency changes (step 7). ``workers/gpu/loads.py`` moves shards; this module only keeps the books.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from lora_cache.vocab import AdapterKey, Delta, ReadinessRecord, capacity_delta
from workers.counters import CacheCounters
from workers.gpu.copies import SlotLoad
from workers.gpu.slots import SlotPhase, SlotTable

log = logging.getLogger(__name__)


class SlotBook:
    """A rank's slots and loads, shared by its cache and its load path under ``lock``.

    ``on_change`` gets one ``Delta`` per residency change: queued under the lock (so in the order of the
    changes), handed over by ``report`` once the lock is released."""

    def __init__(self, num_slots: int, on_change: Callable[[Delta], None] | None, num_pages: int | None = None) -> None:
        self.lock = threading.Lock()  # protects table, loads, pending, last_use, broken, counters, LoadPath's waiters
        self.table = SlotTable(num_slots, num_pages)
        self.counters = CacheCounters()
        self.loads: dict[int, SlotLoad] = {}  # slot -> its load (LOADING or READY)
        self.pending: dict[AdapterKey, SlotLoad] = {}  # staging on the host, no slot yet
        self.last_use: list[Any] = [None] * self.table.num_pages  # compute-done event of each page's last batch
        # exclusive tiers: the write-back pieces in flight, (first pool element, end element, event) in issue order,
        # for the loads into the pages they copy out (``prune``d once complete)
        self.vacating: list[tuple[int, int, Any]] = []
        self.broken: set[int] = set()  # slots whose load failed mid-way while a batch held them: freed at 0 refs
        self.on_change = on_change
        self.on_room: Callable[[], None] | None = None  # a slot became idle or free in drop_refs (LoadPath's waiters)
        self._changes: deque[Delta] = deque()  # residency changes not yet handed to on_change, oldest first
        # a slot's adapter left it ("gone", "failed"): its name is handed to ``on_freed`` by ``report`` (the cache's
        # catalog retires the older versions no slot holds any more: ``AdapterCatalog.trim``)
        self.on_freed: Callable[[str], object] | None = None
        self._freed: deque[str] = deque()
        self._reporting = threading.RLock()  # one thread hands changes over at a time (keeps their order)

    def changed(self, key: AdapterKey, state: str, record: ReadinessRecord | None = None, error: str = "",
                acquired: bool = False) -> None:
        """Queue one residency change (caller holds the lock, so the queue is in the order of the changes);
        ``acquired``: a load the rank started itself, not a command (the controller believes its READY:
        controller/claims.py)."""
        if self.on_change is not None:
            self._changes.append(Delta(key.name, key.version, state, record, error, acquired))
        if state in ("gone", "failed") and self.on_freed is not None:
            self._freed.append(key.name)

    def report(self) -> None:
        """Hand the queued changes to ``on_change``, oldest first (caller does not hold the lock).

        Whoever queued a change calls this after releasing the lock; one thread hands over at a time, so
        a change is never reported before one that happened earlier, and none waits for a later call."""
        with self._reporting:
            while self._changes:
                delta = self._changes.popleft()
                try:
                    if self.on_change is not None:
                        self.on_change(delta)
                except Exception:  # a broken consumer must not break loads; the controller's resync repairs
                    log.exception("residency change %s not reported", delta)
            while self._freed:
                name = self._freed.popleft()
                try:
                    if self.on_freed is not None:
                        self.on_freed(name)
                except Exception:  # the versions stay loadable until the next trim: nothing is lost
                    log.exception("older versions of %s not retired", name)

    def resized(self, gpu_bytes: int, page_bytes: int) -> None:
        """Queue the pool's new capacity for adapters (caller holds the lock): after the evictions that made it,
        in the same ordered stream (``capacity_delta``)."""
        if self.on_change is not None:
            self._changes.append(capacity_delta(gpu_bytes, page_bytes))

    def lent_after(self, pages: tuple[int, ...], page_numel: int) -> tuple[Any, ...]:
        """What a page lent to the engine must wait for before the engine writes it (caller holds the lock): the
        last batch that read it (invariant 2) and every write-back in flight that copies it out (``prune`` first).
        The pages' last use is forgotten here: the engine's use of them is its own until it gives them back."""
        events: list[Any] = []
        for p in pages:
            start, stop = p * page_numel, (p + 1) * page_numel
            for event in (self.last_use[p], *(e for b, s, e in self.vacating if b < stop and s > start)):
                if event is not None and not any(event is e for e in events):
                    events.append(event)
            self.last_use[p] = None
        return tuple(events)

    def versions_held(self, name: str) -> set[str]:
        """The versions of ``name`` in a slot (any state) or on their way to one here (takes the lock)."""
        with self.lock:
            held = {s.key.version for s in self.table.slots if s.key is not None and s.key.name == name}
            return held | {k.version for k in self.pending if k.name == name}

    def after(self, slot: int) -> tuple[Any, ...]:
        """The last-use events of the pages ``slot`` holds now (caller holds the lock): its first copy waits for
        every batch that read any of them, whichever adapter they held then (invariant 2)."""
        events: list[Any] = []
        for p in self.table.slots[slot].page_range:
            event = self.last_use[p]
            if event is not None and not any(event is e for e in events):
                events.append(event)
        return tuple(events)

    def prune(self, done: Callable[[Any], bool]) -> None:
        """Forget the write-back pieces that completed (caller holds the lock)."""
        if self.vacating and any(done(event) for _, _, event in self.vacating):
            self.vacating = [piece for piece in self.vacating if not done(piece[2])]

    def retire(self, slot: int) -> None:
        """The table freed ``slot`` (caller holds the lock): forget its load, counted for prefetch accuracy."""
        load = self.loads.pop(slot)
        self.counters.retired(load.prefetched, load.used)

    def free_failed(self, slot: int) -> None:
        """A failed load's slot, held by no batch, is free again (caller holds the lock)."""
        self.loads.pop(slot)
        self.table.fail(slot)

    def drop_refs(self, held: list[int], last_use: Any) -> None:
        """Let go of a batch's slots; ``last_use`` (if not None) is the event of its kernels' completion."""
        room = False
        with self.lock:
            for index in held:
                if last_use is not None:
                    for p in self.table.slots[index].page_range:
                        self.last_use[p] = last_use
                self.table.decref(index)
                if self.table.slots[index].refs == 0:
                    room = True
                    if index in self.broken:
                        self.broken.discard(index)
                        self.free_failed(index)
        if room and self.on_room is not None:
            self.on_room()

    def unfence(self) -> None:
        """Lift the table's fence (``SlotTable.fence``; nothing if none): the slots it kept may be evicted again, and
        loads that waited for room retry."""
        with self.lock:
            room = self.table.unfence()
        if room and self.on_room is not None:
            self.on_room()

    def check_integrity(self, done: Callable[[Any], bool]) -> None:
        """The table, the loads and the slots agree; ``done(event)``: whether a copy's event completed."""
        with self.lock:
            self.table.check_integrity()
            for s in self.table.slots:
                assert (s.key is not None) == (s.index in self.loads), f"slot {s.index} and its load disagree"
                if s.key is not None:
                    assert self.loads[s.index].key == s.key, f"slot {s.index} load is for another adapter"
                    load = self.loads[s.index]
                    if s.state is SlotPhase.READY:  # invariant 4: READY only once every chunk's copy completed
                        assert load.ready_event is not None and done(load.ready_event), \
                            f"slot {s.index} READY before its last chunk's copy completed"
            assert all(self.table.slots[i].refs > 0 for i in self.broken), "a failed slot is held by no batch"
            assert not set(self.pending) & {s.key for s in self.table.slots}, "a pending load already has a slot"
