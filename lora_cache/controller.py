"""The controller as a named, detached, restartable Ray actor: it only forwards to ControllerCore.

After a (re)start it first rebuilds its view from the workers' own residency reports (invariant 6),
with a new, larger epoch; only then does it plan. It sends each worker its commands, aggregates
readiness (step 8), answers lookups and long-polls for readiness subscribers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import ray

from lora_cache.control import ControllerConfig, ControllerCore, WorkerId
from lora_cache.readiness import ReadinessEvent

log = logging.getLogger(__name__)

NAMESPACE = "lora-cache"
CONTROLLER_NAME = "lora-cache-controller"
WORKER_PREFIX = "lora-cache-worker:"


def worker_name(worker: WorkerId) -> str:
    return f"{WORKER_PREFIX}{worker.replica}:{worker.rank}"


def parse_worker_name(name: str) -> WorkerId:
    replica, rank = name[len(WORKER_PREFIX):].rsplit(":", 1)
    return WorkerId(replica, int(rank))


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class ControllerActor:
    def __init__(self, config: ControllerConfig, health_s: float = 0.5) -> None:
        self.core = ControllerCore(config, epoch=time.time_ns() // 1000)  # grows across restarts
        self.handles: dict[WorkerId, Any] = {}
        self.health_s = health_s
        self._started = False
        self._start_lock = asyncio.Lock()
        self._events = asyncio.Condition()
        self.rejected = 0

    async def _start(self) -> None:
        async with self._start_lock:
            if self._started:
                return
            await self._rebuild()
            self._started = True
            asyncio.get_running_loop().create_task(self._health_loop())

    async def _rebuild(self) -> None:
        """Adopt the workers that already exist (after a controller restart) from their reports."""
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE and a["name"].startswith(WORKER_PREFIX)]
        infos = []
        for name in names:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                infos.append((handle, await handle.describe.remote()))
            except Exception as e:  # a worker that died meanwhile is simply not adopted
                log.warning("could not adopt %s: %s", name, e)
        for _, info in infos:
            for adapter, path in info["adapters"].items():
                if adapter not in self.core.catalog:
                    self.core.register_adapter(adapter, path)
        for handle, info in infos:
            wid = WorkerId(info["replica"], info["rank"])
            if info["replica"] not in self.core.planner.replicas():
                self.core.add_replica(info["replica"], info["tp"], info["slots"])
            self.handles[wid] = handle
            self._publish(self.core.rebuild_worker(wid, info["residency"]))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_s)
            for wid, handle in list(self.handles.items()):
                try:
                    await asyncio.wait_for(handle.ping.remote(), timeout=10 * self.health_s)
                except Exception:  # dead, restarting or hung: what it held is gone (fault handling)
                    log.warning("worker %s is not answering: dropping its residency", wid)
                    self._publish(self.core.worker_lost(wid))
            await self._plan(full=True)

    # -- topology and adapters ------------------------------------------------------------------
    async def add_replica(self, replica: str, tp: int, slots: int) -> list[str]:
        await self._start()
        workers = self.core.add_replica(replica, tp, slots)
        for wid in workers:
            self.handles[wid] = ray.get_actor(worker_name(wid), namespace=NAMESPACE)
        await asyncio.gather(*(self.handles[w].register_adapter.remote(a, p)
                               for w in workers for a, p in self.core.paths.items()))
        return [worker_name(w) for w in workers]

    async def register_adapter(self, name: str, path: str) -> str:
        await self._start()
        version = self.core.register_adapter(name, path)
        await asyncio.gather(*(h.register_adapter.remote(name, path) for h in self.handles.values()))
        return version

    async def worker_started(self, name: str) -> None:
        """A (re)started worker holds nothing: forget what its predecessor held."""
        await self._start()
        wid = parse_worker_name(name)
        if wid in self.handles:
            self._publish(self.core.worker_lost(wid))
            handle = self.handles[wid]  # its catalog is empty too: replay the registrations first
            await asyncio.gather(*(handle.register_adapter.remote(a, p) for a, p in self.core.paths.items()))
            await self._plan()

    # -- inputs ---------------------------------------------------------------------------------
    async def report_queue(self, replica: str, adapters: list[tuple[str, float]]) -> None:
        await self._start()
        self.core.report_queue(replica, adapters, time.time())
        await self._plan()

    async def hint(self, hints: list[tuple[str, str, str, float]]) -> int:
        """(hint id, adapter, replica, expected in seconds from now); all checked before any is taken."""
        await self._start()
        now = time.time()
        for _, adapter, replica, _ in hints:
            self.core.check_replica(replica)
            self.core.check_adapter(adapter)
        taken = sum(self.core.hint(h, a, r, now + max(0.0, dt), now) for h, a, r, dt in hints)
        await self._plan()
        return taken

    async def cancel_hint(self, hint_id: str) -> bool:
        await self._start()
        return self.core.cancel_hint(hint_id, time.time())

    async def report(self, name: str, deltas: list[tuple[str, str, str]]) -> None:
        """Residency changes pushed by a worker (step 7), in batches."""
        await self._start()
        self._publish(self.core.worker_report(parse_worker_name(name), deltas))
        await self._plan()

    # -- decisions --------------------------------------------------------------------------------
    async def _plan(self, full: bool = False) -> None:
        plan = self.core.plan(time.time(), full=full)
        sends = [(wid, self.handles[wid].apply.remote(cmds)) for wid, cmds in plan.items() if wid in self.handles]
        for wid, ref in sends:
            asyncio.get_running_loop().create_task(self._collect(wid, ref))

    async def _collect(self, wid: WorkerId, ref: Any) -> None:
        try:
            result = await ref
            self.rejected += result.rejected_stale
            for error in result.errors:
                log.warning("worker %s: %s", wid, error)
        except Exception as e:
            log.warning("commands to %s were lost (%s); the next plan repeats them", wid, e)

    def _publish(self, events: list[ReadinessEvent]) -> None:
        if events:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._events:
            self._events.notify_all()

    # -- queries ----------------------------------------------------------------------------------
    async def lookup(self, adapter: str) -> dict[str, list[str]]:
        await self._start()
        found = self.core.readiness.lookup(adapter)
        return {"ready": list(found.ready), "loading": list(found.loading)}

    async def wait_events(self, after: int, replica: str | None = None, adapter: str | None = None,
                          timeout_s: float = 10.0) -> list[ReadinessEvent]:
        """Readiness events after the cursor ``after``; waits up to ``timeout_s`` for one."""
        await self._start()

        def pending() -> list[ReadinessEvent]:
            return self.core.readiness.events_after(after, replica, adapter)

        async with self._events:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._events.wait_for(lambda: bool(pending())), timeout_s)
        return pending()

    async def status(self) -> dict[str, object]:
        await self._start()
        return {**self.core.status(), "workers": len(self.handles), "rejected_commands": self.rejected}

    async def check_integrity(self) -> bool:
        self.core.check_integrity()
        return True
