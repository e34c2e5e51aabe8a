"""Adapters listed at start and registered in the background (lifecycle step 0; issue 44 item 6).

``serve --adapters s3://BUCKET/PREFIX --register background`` lists the prefix once and hands the controller every
adapter found; the service serves at once. Registering 10,000 store adapters asks the store 20,000 requests (a
config and the weights' first range each): at a store's rate of a few hundred a second, minutes, during which
``--register wait`` (the default) serves nothing. In the background instead:

- the ``Backlog`` registers the listed adapters through the actor's ``Registrar`` (so each batch is saved in the
  durable catalog and given to every rank as any registration), one batch of ``BATCH`` at a time, in the listing's
  order, reading ``background_reads`` of them at once (a quarter of ``store_reads`` is left to requests) and
  starting none while a request's registration reads the store (``yielding``, up to ``YIELD_S`` a read);
- a request for an adapter not registered yet is registered on demand under its root (``Resolver``: one lookup per
  name; it does not wait for the backlog), so every listed adapter serves from the start, the first request of one
  not yet reached paying its registration (a few store round trips);
- a name is skipped when its batch comes if it is registered by then (on demand, or by an operator's call), being
  unregistered, or was unregistered since the listing (an operator's unregistration is never undone by the backlog).

What is left of it is saved with the durable state after each batch (and when an operator unregisters a queued
name): a controller that restarts goes on with it, after its catalog is restored (``DurableState.save_backlog``).
Plain asyncio; the actor owns the task and the saves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from lora_cache.controller.registrations import Registered

log = logging.getLogger(__name__)

BATCH = 256  # adapters per register_adapters call: one durable save and one plan per batch


def background_reads(store_reads: int) -> int:
    """Store reads the backlog keeps in flight: three quarters of ``store_reads`` (at the default, 24 of the store
    client's 32 connections), so a request's registration on demand does not queue behind the backlog's."""
    return max(1, store_reads - max(1, store_reads // 4))
Register = Callable[[list[tuple[str, str]]], Awaitable[list[Registered]]]


class Backlog:
    """Listed adapters registered in the background, in order (the module's docstring). ``wanted(name)``: whether
    the name still needs registering when its batch comes."""

    def __init__(self, register: Register, wanted: Callable[[str], bool], batch: int = BATCH) -> None:
        self.register, self.wanted, self.batch_size = register, wanted, batch
        self.queue: deque[tuple[str, str]] = deque()
        self.reading: dict[str, str] = {}  # the batch being registered: name -> path, in order
        self.registered = self.skipped = self.failed = 0
        self.task: asyncio.Task[None] | None = None
        self.gate = threading.Event()  # open unless a request's registration reads the store (``yielding``)
        self.gate.set()
        self._yielding = 0

    def add(self, items: list[tuple[str, str]]) -> int:
        """Queue ``items`` (name, path) after those already queued; the adapters waiting now."""
        self.queue.extend(items)
        if items and (self.task is None or self.task.done()):
            self.task = asyncio.get_running_loop().create_task(self._run(), name="lora-cache-backlog")
        return len(self.queue) + len(self.reading)

    async def _run(self) -> None:
        while self.queue:
            chunk: list[tuple[str, str]] = []
            while self.queue and len(chunk) < self.batch_size:
                name, path = self.queue.popleft()
                if self.wanted(name):
                    chunk.append((name, path))
                else:
                    self.skipped += 1
            if not chunk:
                continue
            self.reading = dict(chunk)
            try:
                done = await self.register(chunk)
            except Exception as e:  # the whole call failed (never expected: each item gets its own error)
                log.warning("the background registration of %d adapters (%s ...) failed: %s: %s", len(chunk),
                            chunk[0][0], type(e).__name__, e)
                self.failed += len(chunk)
                continue
            finally:
                self.reading = {}
            for d in done:
                if d.error is None:
                    self.registered += 1
                    continue
                self.failed += 1
                log.warning("adapter %s was not registered in the background: %s", d.name, d.error)

    def left(self) -> list[tuple[str, str]]:
        """What is not registered yet, in order: the batch being read, then the queue (what a restart goes on with)."""
        return [*self.reading.items(), *self.queue]

    def forget(self, name: str) -> bool:
        """An operator unregistered ``name``: it leaves the queue (and, once saved, what a restart goes on with);
        whether it was queued."""
        kept = [item for item in self.queue if item[0] != name]
        found = len(kept) < len(self.queue)
        self.queue = deque(kept)
        return found

    @contextlib.asynccontextmanager
    async def yielding(self, name: str) -> AsyncIterator[None]:
        """While a request's registration of ``name`` runs: the backlog starts no store read (those in flight
        finish), unless ``name`` is in its batch being read (the request waits for that batch's registration of it,
        in the name's turn: held reads would hold the request)."""
        if name in self.reading:
            yield
            return
        self._yielding += 1
        self.gate.clear()
        try:
            yield
        finally:
            self._yielding -= 1
            if not self._yielding:
                self.gate.set()

    def stats(self) -> dict[str, int]:
        """What waits, what was registered, skipped (registered meanwhile, or unregistered) and refused."""
        return {"waiting": len(self.queue) + len(self.reading), "registered": self.registered,
                "skipped": self.skipped, "failed": self.failed}
