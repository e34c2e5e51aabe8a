"""One controller long poll for every ``WatchReadiness`` stream of a gateway (lifecycle step 8; issue 35).

Each stream used to hold a long poll of the controller of its own (``ControllerActor.poll_events``), so a
thousand idle streams held a thousand of the actor's calls. ``WatchHub`` keeps one poll of the whole log
running while any stream is open and hands each batch to every subscriber, filtered by its replica and
adapter. A new subscriber (or one whose queue overflowed: it stopped reading) first catches up from its own
cursor with reads that do not wait, then takes the hub's batches after that cursor; a resync (the hub's
cursor from before a controller restart, or behind the bounded log) reaches each subscriber as its own
``Resync``, the ready set filtered for it. The semantics are the per-stream poll's: events after the
subscriber's cursor in order, or a resync, never a silent gap.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from lora_cache.controller.readiness import ReadinessEvent, Resync, WatchBatch

MAX_QUEUED = 256  # batches waiting for one subscriber; beyond, it catches up from its cursor by itself
_CATCH_UP = object()  # queued for a subscriber that overflowed


class _Subscriber:
    def __init__(self, replica: str | None, adapter: str | None) -> None:
        self.replica, self.adapter = replica, adapter
        self.queue: asyncio.Queue[Any] = asyncio.Queue()  # WatchBatch, _CATCH_UP, or an exception (the end)
        self.overflowed = False

    def wants(self, e: ReadinessEvent) -> bool:
        return self.replica in (None, e.replica) and self.adapter in (None, e.adapter)

    def offer(self, batch: WatchBatch | BaseException) -> None:
        if isinstance(batch, WatchBatch) and batch.resync is None:
            batch = WatchBatch([e for e in batch.events if self.wants(e)])
            if not batch.events:
                return
        if self.overflowed:
            if not isinstance(batch, WatchBatch):
                self.queue.put_nowait(batch)
            return
        if self.queue.qsize() >= MAX_QUEUED:
            self.overflowed = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(_CATCH_UP)
        else:
            self.queue.put_nowait(batch)


class WatchHub:
    """Readiness subscribers of one gateway over one controller poll (see the module docstring)."""

    def __init__(self, controller: Any, poll_s: float) -> None:
        self.controller, self.poll_s = controller, poll_s
        self.subscribers: set[_Subscriber] = set()
        self.cursor = 0  # the hub's place in the controller's log
        self.polls = 0  # controller long polls made (figures, tests)
        self._task: asyncio.Task[None] | None = None

    async def watch(self, replica: str | None, adapter: str | None, after: int | None) -> AsyncIterator[WatchBatch]:
        """The batches for one subscriber from ``after`` (None: from now); NotFoundError for unknown filters.
        ``adapter`` ``A@REF`` (a kept version, or the tag it was pushed under): that version's events only."""
        version = None
        if adapter is not None and "@" in adapter:
            version = str((await self.controller.lookup_adapter.remote(adapter))["version"])  # NotFoundError: not kept
            adapter = adapter.partition("@")[0]
        async with contextlib.aclosing(self._watch(replica, adapter, after)) as batches:  # its subscriber goes at once
            async for batch in batches:
                if (mine := _of_version(batch, version)) is not None:
                    yield mine

    async def _watch(self, replica: str | None, adapter: str | None,
                     after: int | None) -> AsyncGenerator[WatchBatch, None]:
        newest: int = await self.controller.begin_watch.remote(replica, adapter)
        cursor = newest if after is None else after
        sub = _Subscriber(replica, adapter)
        self.subscribers.add(sub)  # before the catch-up: no batch can fall between the two
        if self._task is None or self._task.done():
            self.cursor = newest
            self._task = asyncio.get_running_loop().create_task(self._poll())
        try:
            item: Any = _CATCH_UP
            while True:
                if item is _CATCH_UP:
                    sub.overflowed = False
                    async for batch in self._catch_up(cursor, replica, adapter):
                        cursor = _after(batch, cursor)
                        yield batch
                elif isinstance(item, BaseException):
                    raise item
                elif item.resync is not None:
                    yield WatchBatch([], _mine(item.resync, cursor, replica, adapter))
                    cursor = item.resync.resume_after
                elif events := [e for e in item.events if e.seq > cursor]:
                    cursor = events[-1].seq
                    yield WatchBatch(events)
                item = await sub.queue.get()
        finally:
            self.subscribers.discard(sub)
            if not self.subscribers and self._task is not None:
                self._task.cancel()
                self._task = None

    async def _catch_up(self, cursor: int, replica: str | None, adapter: str | None) -> AsyncIterator[WatchBatch]:
        """What the controller's log holds after ``cursor`` for these filters, read without waiting."""
        while True:
            batch: WatchBatch = await self.controller.poll_events.remote(cursor, replica, adapter, 0.0)
            if batch.resync is None and not batch.events:
                return
            cursor = _after(batch, cursor)
            yield batch

    async def _poll(self) -> None:
        while self.subscribers:
            try:
                self.polls += 1
                batch: WatchBatch = await self.controller.poll_events.remote(self.cursor, None, None, self.poll_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the controller is unreachable: every stream ends with why (as before)
                for sub in list(self.subscribers):
                    sub.offer(e)
                return
            self.cursor = _after(batch, self.cursor)
            for sub in list(self.subscribers):
                sub.offer(batch)


def _after(batch: WatchBatch, cursor: int) -> int:
    if batch.resync is not None:
        return batch.resync.resume_after
    return batch.events[-1].seq if batch.events else cursor


def _mine(r: Resync, cursor: int, replica: str | None, adapter: str | None) -> Resync:
    ready = tuple(k for k in r.ready if replica in (None, k[0]) and adapter in (None, k[1]))
    return Resync(r.resume_after, cursor, ready, r.reason)


def _of_version(batch: WatchBatch, version: str | None) -> WatchBatch | None:
    """``batch`` as a subscriber to one version sees it (None: nothing left; ``version`` None: all of it)."""
    if version is None:
        return batch
    if batch.resync is not None:
        r = batch.resync
        return WatchBatch([], r._replace(ready=tuple(k for k in r.ready if k[2] == version)))
    events = [e for e in batch.events if e.version == version]
    return WatchBatch(events) if events else None
