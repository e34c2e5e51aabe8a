"""The controller actor's own rhythm: the start latch, the health rounds, plan-and-send (steps 3-4, 6-8).

``ControllerActor`` (actor.py) holds only its remote API; what runs between the calls is here. ``start`` runs
once, before any call is answered: the catalog restored, the workers adopted from their reports (invariant 6),
hints, queues and popularity restored, then the health loop and the pings started. Each health round retries
failed loads past their backoff, resyncs every worker each ``sync_s`` (anti-entropy), asks the workers that did
not answer the rebuild again, replans the whole fleet and persists the snapshots. The pings run on their own,
every ``health_s``: a hung rank is found within ``health_s`` + the ping's timeout, however long a round's plan
and snapshots take (a large catalog's save, a loaded machine: the CI's stop 50 found one 2.01 s late).
``plan`` asks the core for commands and sends them through the links (the callback the links and the registrar
replan with).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from lora_cache.controller.core import ControllerCore
from lora_cache.controller.links import WorkerLinks
from lora_cache.controller.readiness import Doorbell
from lora_cache.controller.request_ids import RequestIds
from lora_cache.controller.snapshots import DurableState
from lora_cache.runtime.metrics import ControllerMetrics


class ControlLoop:
    """Starts the controller once, runs its health rounds, plans and sends; owns the links to the workers."""

    def __init__(self, core: ControllerCore, durable: DurableState, metrics: ControllerMetrics, bell: Doorbell,
                 health_s: float, sync_s: float, request_ids: RequestIds | None = None) -> None:
        self.core, self.durable, self.metrics, self.request_ids = core, durable, metrics, request_ids
        self.links = WorkerLinks(core, metrics, bell.ring, self.plan, call_timeout_s=10 * health_s)
        self.health_s, self.sync_s = health_s, sync_s
        self.first_plan_at: float | None = None  # the restart blip ends here
        # each health round: older versions the ranks let go of retired, with their pushed files (the actor's)
        self.retire: Callable[[], Awaitable[object]] | None = None
        self.started: Callable[[], Awaitable[object]] | None = None  # once started (the actor's backlog restored)
        self._started = False
        self._health: asyncio.Task[None] | None = None
        self._pings: asyncio.Task[None] | None = None
        self._start_lock = asyncio.Lock()  # one start: every call awaits it before it is answered

    async def start(self) -> None:
        async with self._start_lock:
            if self._started:
                return
            await self.durable.restore_catalog(self.core)  # the registrations, versions proven or hashed again
            if self.request_ids is not None:
                await self.durable.restore_answers(self.request_ids)  # a retry by request id: the same answer
            await self.links.adoption.rebuild()  # adopt the workers that already exist, from their reports
            await self.durable.restore(self.core.planner)
            self._started = True
            if self.started is not None:
                await self.started()
            if not self.links.quiet:
                self._health = asyncio.get_running_loop().create_task(self._health_loop())
                self._pings = asyncio.get_running_loop().create_task(self._ping_loop())

    def stop(self) -> None:
        """No more health rounds, lifelines or pings (the service's owner is stopping it)."""
        self.links.quiesce()
        for task in (self._health, self._pings):
            if task is not None:
                task.cancel()

    async def _health_loop(self) -> None:
        last_sync = time.monotonic()
        while True:
            await asyncio.sleep(self.health_s)
            self.core.retry_failed(time.time())
            if self.retire is not None:
                await self.retire()
            self.metrics.ready_counts(self.core.readiness.ready_per_replica())
            if time.monotonic() - last_sync >= self.sync_s:  # anti-entropy: whatever was lost is repaired
                last_sync = time.monotonic()
                await self.links.resync_all()
            self.links.adoption.adopt_late()  # workers that did not answer the rebuild (node lost): asked again
            await self.plan(full=True)
            await self.durable.persist(self.core.planner)
            await self.durable.save_catalog(self.core)

    async def _ping_loop(self) -> None:
        """Every worker pinged each ``health_s`` (a round waits at most the ping's timeout for a hung one)."""
        while True:
            await asyncio.sleep(self.health_s)
            await self.links.ping_all()

    async def plan(self, full: bool = False) -> None:
        t0 = time.perf_counter()
        plan = self.core.plan(time.time(), full=full)
        if self.first_plan_at is None:
            self.first_plan_at = time.time()
        kinds = Counter(type(c).__name__.lower() for cmds in plan.values() for c in cmds)
        self.metrics.plan(time.perf_counter() - t0, full, kinds)
        self.links.send(plan)
