"""The controller as a named, detached, restartable Ray actor: it composes and forwards.

``ControllerCore`` (core.py) knows and decides; ``WorkerLinks`` (links.py) reaches the workers: handles,
their delta streams, adoption, resyncs, pings, commands; ``DurableState`` (snapshots.py) keeps what only
the controller knows in Ray's GCS key-value store; ``Doorbell`` (readiness.py) wakes readiness
subscribers; ``ControlLoop`` (control_loop.py) starts it once, runs the health rounds and sends each plan.
After a (re)start the actor first has the links rebuild its view from the workers' own
residency reports (invariant 6), with a new, larger epoch, then restores hints, queue reports and
popularity; only then does it plan. Each input goes to the core, then a plan goes out through the links.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import ray

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.refs import base_name, split_ref, version_of
from lora_cache.controller.backlog import Backlog, background_reads
from lora_cache.controller.control_loop import ControlLoop
from lora_cache.controller.core import ControllerConfig, ControllerCore, HintOutcome
from lora_cache.controller.device_pushes import DevicePushes, Landed
from lora_cache.controller.fanout import WorkerFanout
from lora_cache.controller.pushes import Pushed, Pushes
from lora_cache.controller.readiness import Doorbell, EventsLost, ReadinessEvent, WatchBatch
from lora_cache.controller.registrations import Registered, Registrar, check_item
from lora_cache.controller.request_ids import Item, RequestIds
from lora_cache.controller.resolver import HintTuple, Resolver, unregistered_hints
from lora_cache.controller.snapshots import DurableConfig, DurableState
from lora_cache.errors import ConflictError, LoraCacheError, NotFoundError
from lora_cache.routing.advice import RouteAdvice, RouteRequest
from lora_cache.runtime import heap
from lora_cache.runtime.metrics import ControllerMetrics
from lora_cache.vocab import CONTROLLER_NAME as CONTROLLER_NAME  # re-exported: callers import it from here
from lora_cache.vocab import DeltaRow, worker_name


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class ControllerActor:
    """Forwards every call to the core, the links or the durable state; every method but ``__init__`` is a remote
    method of its API. Its own state is only the adapters being drained and the figures ``status`` reports; the
    start latch, the health rounds and plan-and-send are ``ControlLoop``'s (control_loop.py)."""

    def __init__(self, config: ControllerConfig, health_s: float = 0.5, sync_s: float = 5.0,
                 durable: DurableConfig | None = None) -> None:
        self.started_at = time.time()
        self.core = ControllerCore(config, epoch=time.time_ns() // 1000)  # grows across restarts
        self.durable = DurableState(durable or DurableConfig(), ray.get_runtime_context().namespace)  # the service's
        self.metrics = ControllerMetrics(config.planner.policy)
        self.bell = Doorbell()
        # the start latch, the health rounds, plan-and-send; it owns the links to the workers
        self.request_ids = RequestIds()  # registrations' answers by the client's request id (retries)
        self.loop = ControlLoop(self.core, self.durable, self.metrics, self.bell, health_s, sync_s, self.request_ids)
        self.links = self.loop.links
        self.draining: set[str] = set()  # unregistered adapters that workers may still hold
        self.fanout = WorkerFanout(self.links)  # one question to every worker: registrations, drains, stats
        self.registrar = Registrar(self.core, self.fanout, self.draining, self.loop.plan)
        self.resolver = Resolver(self.core.catalog, self._register_on_demand)  # request-time registration
        self.pushes = Pushes(self.core, self.registrar, ray.get_runtime_context().namespace)  # from trainers' memory
        self.devices = DevicePushes(self.pushes)  # from trainers' device buffers, landed after the ranks took them
        self.loop.retire = self.devices.health_round  # device pushes never landed; versions no rank holds, past keep
        # listed at start, registered in the background (serve --register background); on demand meanwhile
        self.saving: set[asyncio.Task[None]] = set()  # durable saves behind registrations on demand
        self.backlog = Backlog(self._register_backlog, lambda name: name not in self.core.catalog
                               and name not in self.draining and name not in self.resolver.unregistered)
        self.loop.started = self._restore_backlog  # a predecessor's backlog goes on
        heap.freeze()  # plans and hints are not stalled by full collections walking Ray's objects

    # -- topology and adapters ------------------------------------------------------------------
    async def add_replica(self, replica: str, tp: int, slots: int) -> list[str]:
        await self.loop.start()
        workers = self.core.add_replica(replica, tp, slots)
        await self.links.attach(workers)
        return [worker_name(w) for w in workers]

    async def register_adapter(self, name: str, path: str) -> str:
        """Register one adapter (``register_adapters`` of one); its version, or the item's error raised."""
        version, _ = await self.register_adapter_info(name, path)
        return version

    async def register_adapter_info(self, name: str, path: str, request_id: str = "") -> tuple[str, str]:
        """``register_adapter``, answering (its version, the version it replaced or "")."""
        done = await self.register_one(name, path, request_id)
        return done.version, done.previous

    async def register_one(self, name: str, path: str, request_id: str = "") -> Registered:
        """Register one adapter: its ``Registered`` (the ranks that did not answer named in ``rank_pending``), or the
        item's error raised. A rank that refused the version fails the call (the controller has registered it: its
        loads there fail until fixed); a rank that did not answer (restarting) does not: the registration is
        durable and that rank is given it when it is adopted again or restarts (issue 46 item 3a: it answered
        FAILED_PRECONDITION, "no answer", though applied)."""
        (done,) = await self.register_adapters([(name, path)], [request_id])
        if done.error is not None:
            raise done.error
        if done.rank_errors:
            raise ConflictError(f"adapter {name!r} is registered as version {done.version}, but "
                                f"{len(done.rank_errors)} rank(s) refused it: {'; '.join(done.rank_errors)}")
        return done

    async def register_adapters(self, items: list[tuple[str, str]],
                                request_ids: list[str] | None = None) -> list[Registered]:
        """Register many (name, path) items, each by itself (its own error, its name left as it was), with
        the files read on a thread; one plan after (``registrations.Registrar``). In the items' order.
        ``request_ids`` (one per item, "" for none): an id answered before is answered the same again
        (``request_ids.RequestIds``)."""
        await self.loop.start()
        ids = request_ids or [""] * len(items)
        done = await self.request_ids.run([Item(n, p, r) for (n, p), r in zip(items, ids)], self.registrar.register)
        await self.durable.save_catalog(self.core)  # what was answered registered survives a restart
        await self.durable.save_answers(self.request_ids)  # ... and so does its answer, for a retry by its id
        return done

    async def register_later(self, items: list[tuple[str, str]]) -> int:
        """Register (name, path) items in the background, in order (``backlog.py``; each not yet registered when
        its batch comes); a request for one not reached yet registers it on demand. The adapters waiting now."""
        await self.loop.start()
        for name, path in items:  # the whole list checked before any is queued: a bad one refuses the call
            check_item(name, path, None)
        waiting = self.backlog.add(list(items))
        await self.durable.save_backlog(self.backlog.left())  # a restart goes on with it
        return waiting

    async def _register_backlog(self, items: list[tuple[str, str]]) -> list[Registered]:
        """A batch of the backlog, registered with fewer store reads at once than the store client holds
        (``backlog.background_reads``): a request's registration on demand meanwhile finds a connection free."""
        done = await self.registrar.register(items, store_reads=background_reads(self.core.catalog.config.store_reads),
                                             gate=self.backlog.gate)
        await self.durable.save_catalog(self.core)  # what was registered survives a restart
        await self.durable.save_backlog(list(self.backlog.queue))  # ... and what is left goes on after a restart
        return done

    async def _restore_backlog(self) -> None:
        if items := await self.durable.restore_backlog():
            self.backlog.add(items)

    async def resolve_adapter(self, name: str) -> str:
        """The version of ``name``, registered on demand if it lies under an adapter root and nobody registered it
        (``resolver.py``: one lookup per name, a deadline, caps; typed errors). An engine asks before it takes a
        request for a name its catalog lacks."""
        await self.loop.start()
        return await self.resolver.resolve(name)

    async def _register_on_demand(self, name: str, path: str) -> tuple[str, LoraCacheError | None]:
        """A request's registration (``Resolver``): the backlog's store reads yield to it, and it answers without
        waiting for the durable catalog's save (saved behind it: a restart before then resolves it again)."""
        async with self.backlog.yielding(name):
            (done,) = await self.registrar.register([(name, path)])
        self._save_later()
        return done.version, done.error

    def _save_later(self) -> None:
        task = asyncio.get_running_loop().create_task(self.durable.save_catalog(self.core))
        self.saving.add(task)  # held: the loop keeps only a weak reference
        task.add_done_callback(self.saving.discard)

    async def push_adapter(self, name: str, tag: str | int | None, config: bytes, weights: bytes) -> Pushed:
        """A version of ``name`` pushed from a trainer's memory (``pushes.py``): ``config`` the PEFT config's JSON
        bytes, ``weights`` the safetensors bytes, or an ObjectRef of them passed at the top level (Ray resolves
        it here: the bytes never pass through the gateway). Its ``Pushed``, or the error (nothing changed)."""
        await self.loop.start()
        done = await self.pushes.push(name, tag, config, weights)
        await self.durable.save_catalog(self.core)  # what was answered registered survives a restart
        return done

    async def push_device(self, name: str, tag: str | int, config: bytes, head: bytes, size: int) -> Pushed:
        """A version of ``name`` pushed from a trainer's device buffer (``device_pushes.py``): registered device-only
        from its config, its image's header ``head`` and size; the trainer then has its replica's ranks take it from
        the buffer (their doorbells) and lands its node copy (``land_device``). Its ``Pushed``, or the error."""
        await self.loop.start()
        return await self.devices.push(name, tag, config, head, size)

    async def reserve_device(self, name: str, tag: str | int, config: bytes, head: bytes, size: int) -> Pushed:
        """Register version ``tag`` of ``name`` ahead of its device push (``DevicePushes.reserve``): checked as
        ``push_device``'s, loadable on every rank by its id, current nowhere until ``commit_device``. Its ``Pushed``
        (``previous``: the current version now), or the error (nothing changed)."""
        await self.loop.start()
        return await self.devices.reserve(name, tag, config, head, size)

    async def commit_device(self, name: str, version: str) -> Pushed:
        """Make ``name@version``, registered ahead and rung to its trainer's ranks, current (``DevicePushes.commit``);
        its node copy then lands as a device push's (``land_device``). Its ``Pushed``, or the error."""
        await self.loop.start()
        return await self.devices.commit(name, version)

    async def land_device(self, name: str, version: str, config: bytes, weights: bytes) -> Landed:
        """The node copy of device version ``name@version`` (``DevicePushes.land``): the image's bytes, or an ObjectRef
        of them at the top level; its ``Landed``, or the error (it stays device-only until it lands or expires)."""
        await self.loop.start()
        done = await self.devices.land(name, version, config, weights)
        await self.durable.save_catalog(self.core)  # a landed version survives a restart
        return done

    async def withdraw_device(self, name: str, version: str) -> bool:
        """Give up a device push now (``DevicePushes.withdraw``: its trainer saw a rank refuse it); the version before
        it is current again. False if it is not waiting to land."""
        await self.loop.start()
        return await self.devices.withdraw(name, version)

    async def replica_ranks(self, replicas: list[str] | None = None) -> dict[str, list[Any]]:
        """Each replica's rank actors (``replicas``, or every one), in rank order: a trainer opens its device buffer on
        those of its node and GPU (``integrations.ray_push.DevicePusher``)."""
        await self.loop.start()
        out: dict[str, list[tuple[int, Any]]] = {}
        for wid, handle in self.links.handles.items():
            if replicas is None or wid.replica in replicas:
                out.setdefault(wid.replica, []).append((wid.rank, handle))
        return {replica: [h for _, h in sorted(ranks, key=lambda r: r[0])] for replica, ranks in out.items()}

    async def pushed_payload(self, name: str, tag: str) -> tuple[bytes, object]:
        """A pushed version's config and weights bytes, for a rank on another node to copy (``Pushes.payload``)."""
        return await self.pushes.payload(name, tag)

    async def unregister_adapter(self, name: str, timeout_s: float = 30.0) -> list[str]:
        """Stop all new use of ``name``, then wait until no worker holds it; the versions evicted.

        A worker does not evict a slot that running batches still reference, so this waits for those
        references to drain, up to ``timeout_s`` (TimeoutError; calling again resumes the wait). It takes
        its turn after the registrations of ``name`` that arrived before it.
        """
        await self.loop.start()
        if name not in self.draining:
            turn = self.registrar.turns.take(name)
            try:
                await turn.wait()
                self.core.unregister_adapter(name, time.time())  # NotFoundError if it is not registered
                self.draining.add(name)
                self.resolver.forgot(name)  # a hint does not register it again from a root
                if self.backlog.forget(name):  # ... nor the background registration, after a restart too
                    await self.durable.save_backlog(self.backlog.left())
            finally:
                turn.done()
            await self.loop.plan()
            await self.durable.save_catalog(self.core)
        evicted = await self.fanout.drain(name, timeout_s)
        await self.fanout.unregister_adapter(name)
        self.draining.discard(name)
        await self.pushes.forget(name)
        self.devices.forget(name)
        return evicted

    async def worker_started(self, name: str, incarnation: int, adopt: bool = False) -> None:
        """A (re)started worker holds nothing: forget what its predecessor held.

        ``adopt``: a rank that an engine's own process attached (``workers/attach/``) under this name, a new
        actor each time: take its handle and its full report now (its replica is added if new), as a
        restarted controller adopts the workers it finds."""
        await self.loop.start()
        if await self.links.worker_started(name, incarnation, adopt):
            await self.loop.plan()

    async def worker_detached(self, name: str, incarnation: int) -> bool:
        """An attached rank is leaving (``workers/attach/attachment.py``): drop what it held now rather than at the next
        failed health check (which still follows, once its endpoint is gone). False if that incarnation
        of the rank is not the one adopted here."""
        await self.loop.start()
        return self.links.detach(name, incarnation)

    # -- inputs ---------------------------------------------------------------------------------
    async def report_queue(self, replica: str, adapters: list[tuple[str, float]]) -> None:
        await self.loop.start()
        self.core.report_queue(replica, adapters, time.time())
        self.metrics.queues({replica: len(adapters)})
        await self.loop.plan()

    async def hint(self, hints: list[tuple[str, str, str, float]]) -> int:
        """(hint id, adapter, replica, expected in seconds from now); how many were taken. Each hint by itself:
        the good ones are taken, then the first rejected one's error is raised (``hint_batches`` answers each)."""
        (outcome,) = await self.hint_batches([hints])
        if outcome.rejections:
            raise outcome.rejections[0].error
        return outcome.accepted

    async def hint_batches(self, batches: list[list[tuple[str, str, str, float]]]) -> list[HintOutcome]:
        """Many callers' hint batches at once (the gateway coalesces them), each hint by itself; one plan."""
        await self.loop.start()
        asked = time.time()
        outcomes = self.core.hint_batches(batches, asked)
        if self.resolver.on():  # a name nobody registered under a root: resolved, then hinted (``resolver.py``)
            outcomes, waiting = unregistered_hints(batches, outcomes, self.core.catalog,
                                                   self.core.planner.view.replicas(), self.resolver.may_find)
            for name, hints in waiting.items():
                async def again(hints: list[HintTuple] = hints) -> None:
                    late = time.time() - asked  # the hints' expected times counted from when they were sent
                    self.core.hint_batches([[(i, a, r, max(0.0, dt - late)) for i, a, r, dt in hints]], time.time())
                    await self.loop.plan()

                self.resolver.later(name, again)
        self.metrics.hint_outcome(sum(o.accepted for o in outcomes), sum(o.ignored for o in outcomes))
        await self.loop.plan()
        return outcomes

    async def cancel_hint(self, hint_id: str) -> bool:
        await self.loop.start()
        return self.core.cancel_hint(hint_id, time.time())

    async def cancel_hints(self, hint_ids: list[str]) -> int:
        """Withdraw many hints; how many were active."""
        await self.loop.start()
        now = time.time()
        cancelled = sum(self.core.cancel_hint(h, now) for h in hint_ids)
        await self.loop.plan()
        return cancelled

    async def report(self, name: str, incarnation: int, deltas: list[DeltaRow]) -> None:
        """Residency changes pushed by a worker (step 7), in batches of (seq, adapter, version, state,
        error[, read_s]). Deltas already applied (a resync covered them) are skipped; a gap triggers a resync."""
        await self.loop.start()
        if self.links.receive(name, incarnation, deltas):
            await self.loop.plan()

    # -- queries ----------------------------------------------------------------------------------
    async def lookup(self, adapter: str) -> dict[str, list[str]]:
        await self.loop.start()
        found = self.core.readiness.lookup(adapter)
        return {"ready": list(found.ready), "loading": list(found.loading)}

    async def lookup_adapter(self, adapter: str) -> dict[str, object]:
        """Where the current version of a registered adapter is ready or loading (NotFoundError if unknown); or,
        for ``NAME@REF`` (``adapters/refs.py``: a kept version, or the tag it was pushed under), that very version."""
        await self.loop.start()
        name, ref = split_ref(adapter)
        if ref is not None:
            version = version_of(self.core.catalog, name, ref)
            found = self.core.readiness.lookup(name, version)
            return {"adapter": adapter, "version": version, "ready": list(found.ready), "loading": list(found.loading)}
        version = self.core.catalog.get(adapter).version
        found = self.core.readiness.lookup(adapter)
        ready = [r for r in found.ready if self.core.readiness.is_ready(r, adapter, version)]
        return {"adapter": adapter, "version": version, "ready": ready, "loading": list(found.loading)}

    async def declare_limits(self, replica: str, max_adapters: int, max_running: int) -> None:
        """A replica's engine admits at most ``max_adapters`` distinct adapters and ``max_running`` requests per
        batch (its ``EngineConfig``): routing advice ranks what it can start now (``lora_cache.routing.limits``)."""
        await self.loop.start()
        if replica not in self.core.planner.view.replicas():
            raise NotFoundError(f"replica {replica!r} is not known; known: {list(self.core.planner.view.replicas())}")
        self.core.limits.declare(replica, max_adapters, max_running)

    async def declared_limits(self, replica: str) -> tuple[int, int]:
        """The ``(max_adapters, max_running)`` declared for ``replica`` (0: not declared)."""
        await self.loop.start()
        lim = self.core.limits.limits(replica)
        return lim.max_adapters, lim.max_running

    async def route(self, items: list[RouteRequest], outstanding: dict[str, float] | None = None,
                    finished: Sequence[tuple[str, str]] = ()) -> list[RouteAdvice]:
        """Routing advice for a batch (ControllerCore.route; ``finished``: the router's requests that finished since
        its last call, as (replica, adapter)); per-item errors ride in the advice. An item naming an
        adapter nobody registered that lies under an adapter root has it registered first (``resolve_adapter``);
        an item whose resolution failed carries that failure (not found, over capacity, timed out)."""
        await self.loop.start()
        names = {base_name(i.adapter) for i in items}  # ``A@REF``: a version of A (``adapters/refs.py``)
        unknown = sorted(n for n in names if n not in self.core.catalog) if self.resolver.on() else []
        found = await asyncio.gather(*(self.resolver.resolve(a) for a in unknown), return_exceptions=True)
        for e in found:
            if isinstance(e, BaseException) and not isinstance(e, LoraCacheError):
                raise e  # a bug, not an answer
        failed = {a: e for a, e in zip(unknown, found) if isinstance(e, LoraCacheError)}
        advice = self.core.route(items, outstanding, finished)
        return [a._replace(error=failed[name]) if a.error is not None and (name := base_name(a.adapter))
                in failed else a for a in advice]

    async def begin_watch(self, replica: str | None = None, adapter: str | None = None) -> int:
        """Check a readiness subscriber's filters (NotFoundError for unknown names); the current cursor."""
        await self.loop.start()
        if replica:
            self.core.check_replica(replica)
        if adapter:
            self.core.check_adapter(adapter)
        return self.core.readiness.last_seq

    async def poll_events(self, after: int, replica: str | None = None, adapter: str | None = None,
                          timeout_s: float = 10.0) -> WatchBatch:
        """Readiness events after the cursor ``after``, waiting up to ``timeout_s`` for one; or at once a
        resync (the current ready set and the cursor to resume from) if some of them are gone."""
        await self.loop.start()

        def pending() -> WatchBatch:
            return self.core.readiness.read(after, replica, adapter)

        await self.bell.wait(lambda: any(pending()), timeout_s)
        return pending()

    async def wait_events(self, after: int, replica: str | None = None, adapter: str | None = None,
                          timeout_s: float = 10.0) -> list[ReadinessEvent]:
        """``poll_events`` for readers that cannot take a resync: a gap raises ``EventsLost``."""
        batch = await self.poll_events(after, replica, adapter, timeout_s)
        if batch.resync is not None:
            raise EventsLost(batch.resync)
        return batch.events

    async def stop_watching(self) -> None:
        """The service's owner is about to stop it (``Service.stop``): no more health rounds, lifelines or
        pings, so the workers' orderly deaths are not taken for losses. Returns once nothing watches them;
        there is no way back (the owner kills this actor next)."""
        self.loop.stop()

    async def ping(self) -> bool:
        """Answers at once while the actor's loop runs (the gateway's health check); starts nothing."""
        return True

    async def status(self) -> dict[str, object]:
        await self.loop.start()
        return {**self.core.status(), "workers": len(self.links.handles), "rejected_commands": self.links.rejected,
                "started_at": self.started_at, "first_plan_at": self.loop.first_plan_at,
                "restored": self.durable.restored, "snapshots_written": self.durable.snapshots.writes,
                "catalog_restored": self.durable.catalog_restored,
                "request_ids": {"kept": len(self.request_ids), "repeats": self.request_ids.repeats,
                                "restored": self.durable.answers_restored},
                "catalog_snapshots": self.durable.catalog.writes,
                "catalog_snapshot_bytes": self.durable.catalog.bytes, "resolver": self.resolver.stats(),
                "backlog": {**self.backlog.stats(), "restored": self.durable.backlog_restored}}

    async def resize_pool(self, replica: str, lent_bytes: int,
                          keep: list[str] | None = None) -> list[dict[str, object]]:
        """Every rank of ``replica`` lends ``lent_bytes`` of its GPU pool to its engine in all (a pool that breathes,
        issue 43 item 3; ``WorkerFanout.resize_pool``): each rank's pool afterwards. The ranks report their new
        capacity themselves (a "capacity" delta), and the planner plans within it."""
        await self.loop.start()
        return await self.fanout.resize_pool(replica, lent_bytes, list(keep or ()))

    async def worker_stats(self, timeout_s: float = 2.0) -> list[dict[str, object]]:
        """Each worker's cache counters (``stats`` None if it did not answer in time) and slot count."""
        await self.loop.start()
        return await self.fanout.stats(timeout_s)

    async def catalog_config(self) -> CatalogConfig:
        """The catalog every worker must share (model shape, largest rank, adapter roots): an attached
        engine's rank builds its own from it."""
        return self.core.config.catalog

    async def check_integrity(self) -> bool:
        self.core.check_integrity()
        return True
