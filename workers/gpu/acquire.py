"""Lifecycle step 9: an engine's batch holds its adapters' slots (``acquire``) and lets go (``release``).

``acquire`` takes a reference on each adapter's slot (starting an on-demand load for one not resident), uploads
the batch's slot indices (``workers.gpu.slot_index``), and makes the compute stream wait on loads in flight: all of
each, or per layer (``pipelined``: ``workers.gpu.chunk_waits``). ``release`` records the step's compute-done
event as the slots' last use, which a later load into them waits on (step 6). The state is the ``SlotBook``'s,
under its lock; ``WorkerCache`` composes this with the loads it starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.errors import LoraCacheError, NotFoundError, SlotsBusyError
from lora_cache.vocab import AdapterKey, ReadinessRecord
from workers.gpu.book import SlotBook
from workers.gpu.chunk_waits import ChunkWaits
from workers.gpu.copies import LoadFailed
from workers.gpu.slot_index import IndexUploader
from workers.gpu.slots import SlotPhase

AdapterRef = str | AdapterKey  # a name (its current version, looked up when acquired) or one exact version


def resolve(catalog: AdapterCatalog, ref: AdapterRef) -> AdapterKey:
    """The exact version ``ref`` stands for: itself, or the current version of a name."""
    return ref if isinstance(ref, AdapterKey) else AdapterKey(ref, catalog.current(ref))


class Batch(NamedTuple):
    """What ``acquire`` hands the engine: per-request slot indices, on the host and on the device."""

    adapters: tuple[AdapterRef, ...]  # as the caller named them, in batch order
    slots: tuple[int, ...]  # slot of each request, in batch order (-1: not held, see ``failed``)
    slot_index: torch.Tensor | None  # the same, int32 on the device (valid until the ring wraps); None for
    # a pin (``acquire_ready``): nothing is computed with it
    held: tuple[int, ...]  # distinct slots referenced by this batch
    token: list[bool]  # [released?], guards double release
    keys: tuple[AdapterKey, ...] = ()  # the exact version each request computes with, in batch order
    failed: tuple[tuple[AdapterRef, str], ...] = ()  # ``partial`` acquire: (ref, why) of each not held
    waits: ChunkWaits | None = None  # pipelined: the per-layer chunk waits of its loads in flight


def _unresolved(ref: AdapterRef) -> AdapterKey:
    """The key of a ref that could not be resolved (a name no longer registered): no version."""
    return ref if isinstance(ref, AdapterKey) else AdapterKey(ref, "")


class Acquirer:
    """The engine's side of one rank's slots: batches held and released (``WorkerCache.acquire``/``release``).
    ``start(name, version, slot_wait_s=S)`` starts an on-demand load of a version not resident (the cache's
    prefetch)."""

    def __init__(self, book: SlotBook, catalog: AdapterCatalog, streams: Any, device: torch.device, max_batch: int,
                 on_miss: str, tp_rank: int, start: Callable[..., Future[ReadinessRecord]]) -> None:
        self.book, self.catalog, self.streams, self.start = book, catalog, streams, start
        self.max_batch, self.on_miss, self.tp_rank = max_batch, on_miss, tp_rank
        self.index = IndexUploader(streams, max_batch, device)  # per-batch slot indices, a pinned ring

    def acquire(self, adapters: Sequence[AdapterRef], *, partial: bool = False, pipelined: bool = False,
                slot_wait_s: float = 0.0) -> Batch:
        """Slots for a batch's adapters; the compute stream waits (on the GPU) for loads in flight: for
        all of each (the host waiting until its last chunk's copy is issued), or, ``pipelined``, layer by
        layer through the batch's ``waits`` (``workers.gpu.chunk_waits``; the host waits only for a slot).

        Each adapter is a name (its current version) or an ``AdapterKey``: exactly that version, loaded if
        it is not resident (invariant 1: a TP rank never computes a request with another version than
        the one it was admitted with). ``partial``: an adapter that cannot be held (unknown version, a
        failed load, no slot) gets slot -1 and is listed in ``failed`` instead of failing the batch.
        ``slot_wait_s``: a load this call starts that finds every slot held by running batches waits that long
        for one to be let go (a request's lease, holding nothing else meanwhile), then fails (``SlotsBusyError``);
        0 (an engine's step, whose own batches hold the slots): it fails at once."""
        if not 0 < len(adapters) <= self.max_batch:
            raise ValueError(f"acquire takes 1..{self.max_batch} adapters (max_batch), got {len(adapters)}")
        held: dict[AdapterRef, int] = {}
        keys: dict[AdapterRef, AdapterKey] = {}
        failed: dict[AdapterRef, str] = {}
        try:
            for ref in dict.fromkeys(adapters):
                try:
                    keys[ref] = resolve(self.catalog, ref)
                    held[ref] = self._hold(keys[ref], pipelined, slot_wait_s)
                except LoraCacheError as e:
                    if not partial:
                        raise
                    failed[ref] = str(e)
            with self.book.lock:
                loading = {ref: self.book.loads[i] for ref, i in held.items()
                           if self.book.table.slots[i].state is SlotPhase.LOADING}
            waits = ChunkWaits(self.streams, list(loading.values())) if pipelined and loading else None
            if not pipelined:
                for ref, load in loading.items():
                    try:
                        self.streams.compute_wait(load.last_event())
                    except LoadFailed as e:
                        if not partial:
                            raise
                        failed[ref] = str(e)
                        self.book.drop_refs([held.pop(ref)], None)
        except BaseException:
            self.book.drop_refs(list(held.values()), None)
            raise
        slots = tuple(held.get(a, -1) for a in adapters)
        return Batch(tuple(adapters), slots, self.index.upload(slots), tuple(held.values()), [False],
                     tuple(keys.get(a, _unresolved(a)) for a in adapters), tuple(failed.items()), waits)

    def acquire_ready(self, adapters: Sequence[AdapterRef]) -> Batch | None:
        """References on those of ``adapters`` READY here (a name: its current version; a key: exactly that
        version), taken atomically under the cache lock (no load started, no hit counted): what an engine
        pins before it schedules. None if none is ready. Release it like any batch. A pin runs no kernel:
        it has no device index, and its release leaves the slots' last use (the step that last read them)
        as it was."""
        refs: list[AdapterRef] = []
        keys: list[AdapterKey] = []
        slots: list[int] = []
        with self.book.lock:
            for ref in dict.fromkeys(adapters):
                if len(refs) == self.max_batch or (isinstance(ref, str) and ref not in self.catalog):
                    continue
                key = resolve(self.catalog, ref)
                slot = self.book.table.lookup(key)
                if slot is not None and slot.state is SlotPhase.READY:
                    self.book.table.incref(slot.index)
                    self.book.loads[slot.index].used = True
                    refs.append(ref)
                    keys.append(key)
                    slots.append(slot.index)
        if not refs:
            return None
        return Batch(tuple(refs), tuple(slots), None, tuple(slots), [False], tuple(keys))

    def release(self, batch: Batch) -> None:
        """The batch's kernels are enqueued: record their completion as the slots' last use."""
        if batch.token[0]:
            raise ValueError("batch released twice; release each acquired batch exactly once")
        batch.token[0] = True
        self.book.drop_refs(list(batch.held), None if batch.slot_index is None else self.streams.record_compute())

    def _hold(self, key: AdapterKey, pipelined: bool = False, slot_wait_s: float = 0.0) -> int:
        """A reference on ``key``'s slot, loading it first if it is not resident (its spec is needed only then:
        a resident version is held even if the catalog no longer keeps it)."""
        first = True
        started: Future[ReadinessRecord] | None = None  # the load this call started, if any
        while True:
            with self.book.lock:
                slot = self.book.table.lookup(key)
                if slot is not None:
                    self.book.table.incref(slot.index)
                    self.book.loads[slot.index].used = True
                    if first:
                        self.book.counters.gpu_hits += 1
                    return slot.index
                load = self.book.pending.get(key)
                if first:
                    self.book.counters.gpu_misses += 1
                    first = False
            if load is None:
                if started is not None and started.exception() is not None:  # ours failed: no retry loop
                    raise started.exception()  # type: ignore[misc]
                if self.on_miss == "error":
                    raise NotFoundError(f"adapter {key} is not resident on TP rank {self.tp_rank} and "
                                        "on_miss is 'error'; prefetch it first or set on_miss='load'")
                started = self.start(key.name, key.version, slot_wait_s=slot_wait_s)
                continue
            # on-demand: the host waits for the disk read (pipelined: its first chunk), the GPU for the copies
            (load.placed if pipelined else load.issued).wait()
            if load.future.done() and load.future.exception() is not None:
                if isinstance(load.future.exception(), SlotsBusyError) and slot_wait_s > 0 and started is None:
                    continue  # another's load found no room: this call's own load waits for a slot (slot_wait_s)
                raise load.future.exception()  # type: ignore[misc]
