"""What tests read from, or change in, a ``WorkerCache`` that no caller of the cache needs: functions that
take the cache, so the class keeps only what the engine, the controller and the benches call."""

from __future__ import annotations

from workers.cache import WorkerCache
from workers.gpu.slots import SlotPhase
from workers.gpu.streams import CpuStreams


def use_streams(cache: WorkerCache, streams: CpuStreams) -> None:
    """Run the cache's loads, completions and waits on ``streams`` (the index uploads keep their own)."""
    cache.streams = cache.acquirer.streams = cache.load_path.streams = cache.load_path.watcher.streams = streams
    cache.lender.streams = streams


def slots_in(cache: WorkerCache, phase: SlotPhase) -> int:
    """How many slots are in ``phase``."""
    with cache.book.lock:
        return cache.book.table.count(phase)


def slot_waiters(cache: WorkerCache) -> int:
    """Loads staged on the host that wait for a load in flight to free a slot."""
    with cache.book.lock:
        return len(cache.load_path.slot_waiters)


def loads_without_slot(cache: WorkerCache) -> int:
    """Loads started that have no slot yet (staging, or waiting for host room or a slot)."""
    with cache.book.lock:
        return len(cache.book.pending)


def forget_last_use(cache: WorkerCache, slot: int) -> None:
    """Drop ``slot``'s last-use event: the next load into it no longer waits for the batch that read it last
    (the control of a race test: what a loader without last-use events would do)."""
    with cache.book.lock:
        for page in cache.book.table.slots[slot].page_range:
            cache.book.last_use[page] = None
