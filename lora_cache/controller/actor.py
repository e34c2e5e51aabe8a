"""The controller as a named, detached, restartable Ray actor: it only forwards to ControllerCore.

After a (re)start it first rebuilds its view from the workers' own residency reports (invariant 6),
with a new, larger epoch, and restores the hints, queue reports and popularity it kept in Ray's GCS
key-value store (``durable.py``); only then does it plan. It sends each worker its commands, aggregates
readiness (step 8), answers lookups and long-polls for readiness subscribers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import ray

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.controller.core import ControllerConfig, ControllerCore, HintOutcome
from lora_cache.controller.readiness import EventsLost, ReadinessEvent, WatchBatch
from lora_cache.controller.snapshots import DurableConfig, KvStore, Snapshots, decode
from lora_cache.errors import ConfigError, ConflictError
from lora_cache.routing.advice import RouteAdvice, RouteRequest
from lora_cache.runtime import heap
from lora_cache.runtime.metrics import ControllerMetrics
from lora_cache.vocab import CONTROLLER_NAME as CONTROLLER_NAME  # re-exported: callers import it from here
from lora_cache.vocab import NAMESPACE, WORKER_PREFIX, Evict, WorkerId, parse_worker_name, worker_name

log = logging.getLogger(__name__)

T = TypeVar("T")
WORKER_ATTEMPTS = 30  # a second apart: a restarted worker may still be in its constructor


class Link(NamedTuple):
    """Where the controller stands with one worker's stream of deltas."""

    incarnation: int  # the worker process's start time (ns): a larger one is a restart
    applied: int  # the last delta sequence number applied (or covered by a full report)


async def _while_restarting(call: Callable[[], Awaitable[T]]) -> T:
    """``await call()``, called again while the worker is restarting (``ActorUnavailableError``: Ray
    refuses calls until its constructor returns), a second apart, ``WORKER_ATTEMPTS`` times at most.
    A worker that is gone (``RayActorError``) fails at once."""
    for _ in range(WORKER_ATTEMPTS - 1):
        try:
            return await call()
        except ray.exceptions.ActorUnavailableError:
            await asyncio.sleep(1.0)
    return await call()


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class ControllerActor:
    def __init__(self, config: ControllerConfig, health_s: float = 0.5, sync_s: float = 5.0,
                 durable: DurableConfig | None = None) -> None:
        self.started_at = time.time()
        self.first_plan_at: float | None = None  # the restart blip ends here
        self.core = ControllerCore(config, epoch=time.time_ns() // 1000)  # grows across restarts
        self.snapshots = Snapshots(durable or DurableConfig())
        self.store = KvStore(self.snapshots.config.key, NAMESPACE)
        self.restored: dict[str, int] = {}
        self.handles: dict[WorkerId, Any] = {}
        self.links: dict[WorkerId, Link] = {}  # each worker's incarnation and the last delta applied
        self.health_s, self.sync_s = health_s, sync_s
        self.metrics = ControllerMetrics(config.planner.policy)
        self._started = False
        self._start_lock = asyncio.Lock()
        self._events = asyncio.Condition()
        self.rejected = 0
        self.draining: set[str] = set()  # unregistered adapters that workers may still hold
        heap.freeze()  # plans and hints are not stalled by full collections walking Ray's objects

    async def _start(self) -> None:
        async with self._start_lock:
            if self._started:
                return
            await self._rebuild()
            await self._restore()
            self._started = True
            asyncio.get_running_loop().create_task(self._health_loop())

    async def _rebuild(self) -> None:
        """Adopt the workers that already exist (after a controller restart) from their reports."""
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE and a["name"].startswith(WORKER_PREFIX)]
        infos: list[tuple[Any, Any]] = []
        for name in names:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                infos.append((handle, await _while_restarting(handle.describe.remote)))
            except Exception as e:  # a worker that died meanwhile is simply not adopted
                log.warning("could not adopt %s: %s", name, e)
        for _, info in infos:
            self._learn_adapters(info)
        for handle, info in infos:
            self._adopt(handle, info)

    def _learn_adapters(self, info: dict[str, Any]) -> None:
        for adapter, path in info["adapters"].items():
            if adapter not in self.core.catalog:
                self.core.register_adapter(adapter, path)

    def _adopt(self, handle: Any, info: dict[str, Any]) -> WorkerId:
        """Take a worker's full report as the truth about it (its replica is added if new: ConfigError if
        the replica exists with another TP size or slot count)."""
        wid = WorkerId(info["replica"], info["rank"])
        self.core.add_replica(info["replica"], info["tp"], info["slots"], info.get("host_bytes"))
        self.handles[wid] = handle
        self.links[wid] = Link(info["incarnation"], info["seq"])
        self._publish(self.core.sync_worker(wid, info["residency"]))
        return wid

    async def _restore(self) -> None:
        """Hints, queues and popularity from the last snapshot a predecessor wrote (none on a first start)."""
        try:
            data = await asyncio.to_thread(self.store.get)
            if data:
                restored = self.core.planner.restore_state(decode(data), time.time())
                self.restored = {k: v for k, v in restored._asdict().items() if isinstance(v, int)}
                log.info("restored controller state: %s", self.restored)
        except Exception as e:  # a bad or unreadable snapshot: start without it (hints are re-sent, queues re-reported)
            log.warning("could not restore the controller's state (%s: %s); starting without it", type(e).__name__, e)

    async def _persist(self) -> None:
        """A snapshot of what only the controller knows, if due and changed (the write runs on a thread)."""
        data = self.snapshots.take(self.core.planner, time.monotonic())
        if data is None:
            return
        try:
            await asyncio.to_thread(self.store.put, data)
            self.snapshots.written(data)
        except Exception as e:  # GCS unreachable: the next period tries again
            log.warning("could not save the controller's state: %s", e)

    async def _resync(self, wid: WorkerId) -> None:
        """Repair lost deltas (or commands): replace what is known of a worker by its full report."""
        try:
            info = await self.handles[wid].describe.remote()
        except Exception as e:  # lost: the health loop deals with it
            log.info("resync of %s failed: %s", wid, e)
            return
        link = self.links.get(wid)
        if link is not None and (info["incarnation"], info["seq"]) < (link.incarnation, link.applied):
            return  # older than deltas already applied: the next resync repairs any gap
        self.links[wid] = Link(info["incarnation"], info["seq"])
        self._publish(self.core.sync_worker(wid, info["residency"]))
        await self._plan()

    async def _health_loop(self) -> None:
        last_sync = time.monotonic()
        while True:
            await asyncio.sleep(self.health_s)
            self.core.retry_failed(time.time())
            self.metrics.ready_counts(self.core.readiness.ready_per_replica())
            if time.monotonic() - last_sync >= self.sync_s:  # anti-entropy: whatever was lost is repaired
                last_sync = time.monotonic()
                await asyncio.gather(*(self._resync(wid) for wid in list(self.handles)))
            for wid, handle in list(self.handles.items()):
                try:
                    await asyncio.wait_for(handle.ping.remote(), timeout=10 * self.health_s)
                except Exception:  # dead, restarting or hung: what it held is gone (fault handling)
                    if self.handles.get(wid) is not handle:
                        continue  # re-attached meanwhile (a new process under the name): that one is not lost
                    log.warning("worker %s is not answering: dropping its residency", wid)
                    self._publish(self.core.worker_lost(wid))
            await self._plan(full=True)
            await self._persist()

    # -- topology and adapters ------------------------------------------------------------------
    async def add_replica(self, replica: str, tp: int, slots: int) -> list[str]:
        await self._start()
        workers = self.core.add_replica(replica, tp, slots)
        for wid in workers:
            self.handles[wid] = ray.get_actor(worker_name(wid), namespace=NAMESPACE)
        await self._replay_registrations([self.handles[w] for w in workers])
        return [worker_name(w) for w in workers]

    async def _replay_registrations(self, handles: list[Any]) -> None:
        """Workers new to the controller (or restarted, catalog empty) learn every registered adapter. A
        restarted worker says so from its constructor, so it may still be starting."""
        await _while_restarting(lambda: asyncio.gather(*(h.register_adapter.remote(a, p) for h in handles
                                                         for a, p in self.core.paths.items())))

    async def register_adapter(self, name: str, path: str) -> str:
        await self._start()
        version = self.core.register_adapter(name, path)
        await asyncio.gather(*(h.register_adapter.remote(name, path) for h in self.handles.values()))
        return version

    async def register_adapter_info(self, name: str, path: str) -> tuple[str, str]:
        """``register_adapter``, answering (its version, the version it replaced or "")."""
        await self._start()
        if name in self.draining:
            raise ConflictError(f"adapter {name!r} is being unregistered (waiting for in-use references to "
                              "drain); register it again once UnregisterAdapter has returned")
        previous = self.core.catalog.get(name).version if name in self.core.catalog else ""
        return await self.register_adapter(name, path), previous

    async def unregister_adapter(self, name: str, timeout_s: float = 30.0) -> list[str]:
        """Stop all new use of ``name``, then wait until no worker holds it; the versions evicted.

        A worker does not evict a slot that running batches still reference, so this waits for those
        references to drain, up to ``timeout_s`` (TimeoutError; calling again resumes the wait).
        """
        await self._start()
        if name not in self.draining:
            self.core.unregister_adapter(name, time.time())  # NotFoundError if it is not registered
            self.draining.add(name)
            await self._plan()
        evicted = await self._drain(name, timeout_s)
        # the workers forget it too, or a restarted controller would adopt it again from their reports
        for wid, outcome in zip(self.handles, await asyncio.gather(
                *(h.unregister_adapter.remote(name) for h in self.handles.values()), return_exceptions=True)):
            if isinstance(outcome, BaseException):
                log.warning("worker %s did not unregister %s: %s (a restarted controller may adopt it again)",
                            wid, name, outcome)
        self.draining.discard(name)
        return evicted

    async def _drain(self, name: str, timeout_s: float) -> list[str]:
        deadline, evicted = time.monotonic() + timeout_s, set()
        while held := await self._holders(name):
            if name in self.core.catalog:
                raise ConflictError(f"adapter {name!r} was registered again while it was being unregistered; "
                                  "unregister it again if that was not intended")
            if time.monotonic() > deadline:
                raise TimeoutError(f"adapter {name!r} is unregistered (nothing new uses it), but workers "
                                   f"{sorted(map(str, held))} still hold it after {timeout_s:.0f} s, in use by "
                                   "running batches; call UnregisterAdapter again to keep waiting")
            evicted |= {v for versions in held.values() for v in versions}
            await asyncio.gather(*(self.handles[w].apply.remote([Evict(name, v, self.core.epoch) for v in sorted(vs)])
                                   for w, vs in held.items()))
            await asyncio.sleep(0.05)
        return sorted(evicted)

    async def _holders(self, name: str) -> dict[WorkerId, set[str]]:
        """The versions of ``name`` that each worker holds, from the workers' own full reports."""
        wids = list(self.handles)
        reports = await asyncio.gather(*(self.handles[w].describe.remote() for w in wids), return_exceptions=True)
        held: dict[WorkerId, set[str]] = {}
        for wid, report in zip(wids, reports):
            if isinstance(report, BaseException):  # lost: it comes back empty (worker_started)
                log.warning("worker %s did not report while draining %s: %s", wid, name, report)
                continue
            versions = {v for a, v, _, _ in report["residency"] if a == name}
            if versions:
                held[wid] = versions
        return held

    async def worker_started(self, name: str, incarnation: int, adopt: bool = False) -> None:
        """A (re)started worker holds nothing: forget what its predecessor held.

        ``adopt``: a rank that an engine's own process attached (``workers/attach.py``) under this name, a new
        actor each time: take its handle and its full report now (its replica is added if new), as a
        restarted controller adopts the workers it finds."""
        await self._start()
        wid = parse_worker_name(name)
        if adopt:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            info = await handle.describe.remote()
            if (info["incarnation"], info["replica"], info["rank"]) != (incarnation, wid.replica, wid.rank):
                raise ConflictError(f"{name} answered as rank {info['rank']} of {info['replica']!r}, incarnation "
                                    f"{info['incarnation']} (not {incarnation}): another process holds that name")
            if info["model"] != self.core.catalog.shape.name:
                raise ConfigError(f"{name} serves model {info['model']!r} but the controller plans for "
                                  f"{self.core.catalog.shape.name!r}; attach with the service's model")
            if wid in self.handles:
                self._new_incarnation(wid, incarnation)  # drops what the predecessor held
            self._learn_adapters(info)
            self._adopt(handle, info)
        elif wid in self.handles:
            self._new_incarnation(wid, incarnation)
        if wid in self.handles:
            handle = self.handles[wid]  # its catalog is empty too: replay the registrations first
            await self._replay_registrations([handle])
            await self._plan()

    async def worker_detached(self, name: str, incarnation: int) -> bool:
        """An attached rank is leaving (``workers/attach.py``): drop what it held now rather than at the next
        failed health check (which still follows, once its endpoint is gone). False if that incarnation
        of the rank is not the one adopted here."""
        await self._start()
        wid = parse_worker_name(name)
        link = self.links.get(wid)
        if wid not in self.handles or link is None or link.incarnation != incarnation:
            return False
        self._publish(self.core.worker_lost(wid))
        return True

    # -- inputs ---------------------------------------------------------------------------------
    async def report_queue(self, replica: str, adapters: list[tuple[str, float]]) -> None:
        await self._start()
        self.core.report_queue(replica, adapters, time.time())
        self.metrics.queues({replica: len(adapters)})
        await self._plan()

    async def hint(self, hints: list[tuple[str, str, str, float]]) -> int:
        """(hint id, adapter, replica, expected in seconds from now); all checked before any is taken."""
        (outcome,) = await self.hint_batches([hints])
        if outcome.error is not None:
            raise outcome.error
        return outcome.accepted

    async def hint_batches(self, batches: list[list[tuple[str, str, str, float]]]) -> list[HintOutcome]:
        """Many callers' hint batches at once (the gateway coalesces them), each all or nothing; one plan."""
        await self._start()
        outcomes = self.core.hint_batches(batches, time.time())
        self.metrics.hint_outcome(sum(o.accepted for o in outcomes), sum(o.ignored for o in outcomes))
        await self._plan()
        return outcomes

    async def cancel_hint(self, hint_id: str) -> bool:
        await self._start()
        return self.core.cancel_hint(hint_id, time.time())

    async def cancel_hints(self, hint_ids: list[str]) -> int:
        """Withdraw many hints; how many were active."""
        await self._start()
        now = time.time()
        cancelled = sum(self.core.cancel_hint(h, now) for h in hint_ids)
        await self._plan()
        return cancelled

    async def report(self, name: str, incarnation: int, deltas: list[tuple[int, str, str, str, str]]) -> None:
        """Residency changes pushed by a worker (step 7), in batches of (seq, adapter, version, state,
        error). Deltas already applied (a resync covered them) are skipped; a gap triggers a resync."""
        await self._start()
        wid = parse_worker_name(name)
        if wid not in self.handles:
            return  # not adopted yet: the rebuild reads its full report
        if not self._new_incarnation(wid, incarnation):
            return  # from a predecessor that has since restarted
        link = self.links[wid]
        fresh = [d for d in deltas if d[0] > link.applied]
        if not fresh:
            return
        gap = fresh[0][0] > link.applied + 1
        self.links[wid] = Link(incarnation, fresh[-1][0])
        self._publish(self.core.worker_report(wid, [d[1:] for d in fresh], time.time()))
        if failed := sum(d[3] == "failed" for d in fresh):
            self.metrics.load_failures.inc(failed)
        if gap:
            log.info("deltas from %s were lost (seq %d after %d): resyncing", wid, fresh[0][0], link.applied)
            asyncio.get_running_loop().create_task(self._resync(wid))
        await self._plan()

    def _new_incarnation(self, wid: WorkerId, incarnation: int) -> bool:
        """Note a worker's incarnation; a newer one starts empty. False: an older one (ignore it)."""
        link = self.links.get(wid)
        if link is not None and incarnation < link.incarnation:
            return False
        if link is None or incarnation > link.incarnation:
            if link is not None:
                self._publish(self.core.worker_lost(wid))
            self.links[wid] = Link(incarnation, 0)
        return True

    # -- decisions --------------------------------------------------------------------------------
    async def _plan(self, full: bool = False) -> None:
        t0 = time.perf_counter()
        plan = self.core.plan(time.time(), full=full)
        if self.first_plan_at is None:
            self.first_plan_at = time.time()
        kinds = Counter(type(c).__name__.lower() for cmds in plan.values() for c in cmds)
        self.metrics.plan(time.perf_counter() - t0, full, kinds)
        sends = [(wid, self.handles[wid].apply.remote(cmds)) for wid, cmds in plan.items() if wid in self.handles]
        for wid, ref in sends:
            asyncio.get_running_loop().create_task(self._collect(wid, ref))

    async def _collect(self, wid: WorkerId, ref: Any) -> None:
        try:
            result = await ref
            self.rejected += result.rejected_stale
            self.metrics.rejected_commands(result.rejected_stale, len(result.errors))
            for error in result.errors:
                log.warning("worker %s: %s", wid, error)
        except Exception as e:  # the planner assumed them applied: ask the worker what it holds
            log.warning("commands to %s were lost (%s); resyncing it", wid, e)
            await self._resync(wid)

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

    async def lookup_adapter(self, adapter: str) -> dict[str, object]:
        """Where the current version of a registered adapter is ready or loading (NotFoundError if unknown)."""
        await self._start()
        version = self.core.catalog.get(adapter).version
        found = self.core.readiness.lookup(adapter)
        ready = [r for r in found.ready if self.core.readiness.is_ready(r, adapter, version)]
        return {"adapter": adapter, "version": version, "ready": ready, "loading": list(found.loading)}

    async def route(self, items: list[RouteRequest], outstanding: dict[str, float] | None = None) -> list[RouteAdvice]:
        """Routing advice for a batch (ControllerCore.route); per-item errors ride in the advice."""
        await self._start()
        return self.core.route(items, outstanding)

    async def begin_watch(self, replica: str | None = None, adapter: str | None = None) -> int:
        """Check a readiness subscriber's filters (NotFoundError for unknown names); the current cursor."""
        await self._start()
        if replica:
            self.core.check_replica(replica)
        if adapter:
            self.core.check_adapter(adapter)
        return self.core.readiness.last_seq

    async def poll_events(self, after: int, replica: str | None = None, adapter: str | None = None,
                          timeout_s: float = 10.0) -> WatchBatch:
        """Readiness events after the cursor ``after``, waiting up to ``timeout_s`` for one; or at once a
        resync (the current ready set and the cursor to resume from) if some of them are gone."""
        await self._start()

        def pending() -> WatchBatch:
            return self.core.readiness.read(after, replica, adapter)

        async with self._events:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._events.wait_for(lambda: any(pending())), timeout_s)
        return pending()

    async def wait_events(self, after: int, replica: str | None = None, adapter: str | None = None,
                          timeout_s: float = 10.0) -> list[ReadinessEvent]:
        """``poll_events`` for readers that cannot take a resync: a gap raises ``EventsLost``."""
        batch = await self.poll_events(after, replica, adapter, timeout_s)
        if batch.resync is not None:
            raise EventsLost(batch.resync)
        return batch.events

    async def status(self) -> dict[str, object]:
        await self._start()
        return {**self.core.status(), "workers": len(self.handles), "rejected_commands": self.rejected,
                "started_at": self.started_at, "first_plan_at": self.first_plan_at, "restored": self.restored,
                "snapshots_written": self.snapshots.writes}

    async def worker_stats(self, timeout_s: float = 2.0) -> list[dict[str, object]]:
        """Each worker's cache counters (``stats`` None if it did not answer in time) and slot count."""
        await self._start()
        wids = sorted(self.handles)

        async def one(wid: WorkerId) -> dict[str, object] | None:
            try:
                return await asyncio.wait_for(self.handles[wid].stats.remote(), timeout_s)
            except Exception as e:  # reported as unreachable
                log.info("worker %s gave no stats: %s", wid, e)
                return None

        stats = await asyncio.gather(*(one(w) for w in wids))
        return [{"worker": worker_name(w), "replica": w.replica, "rank": w.rank,
                 "slots": self.core.planner.capacity(str(w)).slots, "stats": s} for w, s in zip(wids, stats)]

    async def catalog_config(self) -> CatalogConfig:
        """The catalog every worker must share (model shape, largest rank, adapter roots): an attached
        engine's rank builds its own from it."""
        return self.core.config.catalog

    async def check_integrity(self) -> bool:
        self.core.check_integrity()
        return True
