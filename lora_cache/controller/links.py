"""The controller's links to its TP workers (lifecycle steps 4 and 7; invariants 6 and 7).

``WorkerLinks`` owns everything about reaching the workers: their Ray handles; where the controller stands
with each one's stream of residency deltas (``Link``: incarnation, last delta applied); adopting a worker
from its full report (``describe``: after a controller restart, or a rank an engine attached); resyncs,
health pings and new incarnations; losses; replaying the registrations a new or restarted worker lacks;
sending commands (``apply``) and reading their results. What it learns goes into the ``ControllerCore``; the
readiness events that causes go to ``publish``; after a worker's state was repaired, ``replan`` (the actor's
plan-and-send). Split along three seams: ``lifelines.py`` notices deaths (what a loss does stays here),
``fanout.py`` asks every worker one question (registrations, the drain's "who holds it", stats), and
``adoption.py`` finds the workers at a (re)start and waits for the silent ones (adopting a report stays here).

One way: the actor imports this module, never the reverse. A handle is anything whose
``handle.method.remote(...)`` is awaitable, so this runs under plain asyncio with fakes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import ray

from lora_cache.controller.adoption import Adoption, while_restarting
from lora_cache.controller.core import HOST_STATES, ControllerCore
from lora_cache.controller.lifelines import Lifelines
from lora_cache.controller.readiness import ReadinessEvent
from lora_cache.errors import ConfigError, ConflictError
from lora_cache.runtime.metrics import ControllerMetrics
from lora_cache.vocab import (
    WORKER_PREFIX,
    Command,
    DeltaRow,
    WorkerId,
    parse_worker_name,
    worker_name,
)

log = logging.getLogger(__name__)

REPLAY_ENTRIES = 256  # registrations per call when a worker is given all of them
PING_TIMEOUT_S = 1.5  # a ping unanswered this long is a miss
# misses in a row that make a worker lost (its replica leaves the plans): one slow answer on a loaded machine is not a
# hang (the CI's 2 cores: a rank just restarted by Ray missed one while its reader processes started, 2026-11-30);
# a dead process is found by its lifeline at once, whatever this says
PING_MISSES = 2


class Link(NamedTuple):
    """Where the controller stands with one worker's stream of deltas."""

    incarnation: int  # the worker process's start time (ns): a larger one is a restart
    applied: int  # the last delta sequence number applied (or covered by a full report)


def _named_workers() -> list[str]:
    """The worker actors that exist in the cluster now, by name."""
    namespace = ray.get_runtime_context().namespace  # the service's (vocab.NAMESPACE)
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and a["name"].startswith(WORKER_PREFIX)]


def _find(name: str) -> Any:
    return ray.get_actor(name)  # in this service's namespace (vocab.NAMESPACE)


class WorkerLinks:
    """The controller's handles on its workers and its place in each one's stream of deltas."""

    def __init__(self, core: ControllerCore, metrics: ControllerMetrics,
                 publish: Callable[[list[ReadinessEvent]], None], replan: Callable[[], Awaitable[None]],
                 find: Callable[[str], Any] = _find, named: Callable[[], list[str]] = _named_workers,
                 call_timeout_s: float = 5.0) -> None:
        self.core, self.metrics, self.publish, self.replan = core, metrics, publish, replan
        # how long the health loop waits on one worker's ping or full report: a stopped (SIGSTOP) or hung
        # worker costs the loop this much, once per round, whatever the number of workers
        self.call_timeout_s = call_timeout_s
        self.find, self.named = find, named  # a worker's handle by name; the names of those that exist
        self.ping_timeout_s = min(call_timeout_s, PING_TIMEOUT_S)
        # pings in a row unanswered, and by which process (its handle and incarnation)
        self.missed: dict[WorkerId, tuple[int, tuple[Any, int | None]]] = {}
        self.handles: dict[WorkerId, Any] = {}
        self.links: dict[WorkerId, Link] = {}  # each worker's incarnation and the last delta applied
        self.losses: dict[WorkerId, int] = {}  # how often each worker was found lost: a report read before
        # a loss and applied after it would bring back what the lost rank held
        self.lifelines = Lifelines(self)  # each linked worker's death watch
        self.attached: set[WorkerId] = set()  # ranks an engine's own process attached: gone for good once lost
        self.resyncing: set[WorkerId] = set()  # workers whose full report is being read (one resync at a time)
        self.adoption = Adoption(self)  # the workers found at a (re)start, adopted from their reports, late ones too
        self.rejected = 0  # commands workers refused as from an older epoch

    # -- adoption (invariant 6) -----------------------------------------------------------------
    def adopt(self, handle: Any, info: dict[str, Any], restart: bool = False) -> WorkerId:
        """Take a worker's full report as the truth about it, as far as the controller believes it (its replica is
        added if new: ConfigError if the replica exists with another TP size or slot count). ``restart``: found
        by a restarted controller, whose predecessor commanded its loads: what it holds of the registered
        versions is believed, once (``ControllerCore.sync_worker``'s ``adopting``)."""
        wid = WorkerId(info["replica"], info["rank"])
        self.core.add_replica(info["replica"], info["tp"], info["slots"], info.get("host_bytes"), info.get("gpu_bytes"),
                              info.get("page_bytes"), info.get("disk_bytes"))
        self.handles[wid] = handle
        self.links[wid] = Link(info["incarnation"], info["seq"])
        self.publish(self.core.sync_worker(wid, info["residency"], info.get("host"), adopting=restart))
        self.lifelines.watch(wid, handle)
        return wid

    async def attach(self, workers: list[WorkerId]) -> None:
        """Workers of a replica just added: find them by name and give them every registration."""
        for wid in workers:
            self.handles[wid] = self.find(worker_name(wid))
            self.lifelines.watch(wid, self.handles[wid])
        await self.replay([self.handles[w] for w in workers])

    async def worker_started(self, name: str, incarnation: int, adopt: bool) -> bool:
        """A (re)started worker holds nothing: forget what its predecessor held (``adopt``: an attached
        rank, a new actor each time: take its handle and full report now). True if the worker is linked
        (its registrations were replayed: the caller replans)."""
        wid = parse_worker_name(name)
        if adopt:
            await self._adopt_attached(name, wid, incarnation)
        elif wid in self.adoption.unadopted:  # it did not answer the rebuild (its node was lost): it answers now
            self.adoption.adopt_late()
            if (task := self.adoption.adopting.get(wid)) is not None:
                await asyncio.shield(task)  # registrations replayed and replanned there: nothing left for the caller
            return False
        elif wid in self.handles:
            self._new_incarnation(wid, incarnation)
        if wid not in self.handles:
            return False
        await self.replay([self.handles[wid]])  # its catalog is empty too: replay the registrations first
        return True

    async def _adopt_attached(self, name: str, wid: WorkerId, incarnation: int) -> None:
        handle = self.find(name)
        info = await handle.describe.remote()
        if (info["incarnation"], info["replica"], info["rank"]) != (incarnation, wid.replica, wid.rank):
            raise ConflictError(f"{name} answered as rank {info['rank']} of {info['replica']!r}, incarnation "
                                f"{info['incarnation']} (not {incarnation}): another process holds that name")
        if info["model"] != self.core.catalog.shape.name:
            raise ConfigError(f"{name} serves model {info['model']!r} but the controller plans for "
                              f"{self.core.catalog.shape.name!r}; attach with the service's model")
        if wid in self.handles:
            self._new_incarnation(wid, incarnation)  # drops what the predecessor held
        # a new attach: nothing it reports was commanded (a new process holds nothing), and nothing a rank reports
        # registers an adapter (the operators' registrations, restored from the durable catalog, stand)
        self.adopt(handle, info)
        self.attached.add(wid)

    def detach(self, name: str, incarnation: int) -> bool:
        """An attached rank is leaving: drop what it held now. False if that incarnation is not the one linked."""
        wid = parse_worker_name(name)
        link = self.links.get(wid)
        if wid not in self.handles or link is None or link.incarnation != incarnation:
            return False
        self.forget(wid)
        return True

    def forget(self, wid: WorkerId) -> None:
        """An attached rank is gone for good (detached, or its endpoint died): it is lost, its handle dropped;
        once no rank of its replica is left, the replica leaves the fleet (a process that attaches again
        adds it anew)."""
        self.lose(wid, "forgotten (detached, or its endpoint died)")
        self.handles.pop(wid, None)
        self.links.pop(wid, None)
        self.attached.discard(wid)
        self.lifelines.drop(wid)
        if wid.replica in self.core.planner.view.replicas() and not any(w.replica == wid.replica for w in self.handles):
            log.info("replica %s has no rank left: it leaves the fleet", wid.replica)
            self.publish(self.core.remove_replica(wid.replica))

    # -- reports (step 7) and repairs -------------------------------------------------------------
    def receive(self, name: str, incarnation: int, deltas: list[DeltaRow]) -> bool:
        """Deltas pushed by a worker: those already applied (a resync covered them) are skipped; a gap
        triggers a resync. True if any slot's change was applied (the caller replans; the host tiers' changes
        are routing's, not the planner's)."""
        wid = parse_worker_name(name)
        if wid not in self.handles:
            return False  # not adopted yet: the rebuild reads its full report
        if not self._new_incarnation(wid, incarnation):
            return False  # from a predecessor that has since restarted
        if wid in self.core.lost.down:  # lost: only a full report (``resync``) proves it is alive again; these
            self.resync_soon(wid)  # deltas may predate its death
            return False
        link = self.links[wid]
        fresh = [d for d in deltas if d[0] > link.applied]
        if not fresh:
            return False
        gap = fresh[0][0] > link.applied + 1
        self.links[wid] = Link(incarnation, fresh[-1][0])
        self.publish(self.core.worker_report(wid, [d[1:] for d in fresh], time.time()))
        if failed := sum(d[3] == "failed" for d in fresh):
            self.metrics.load_failures.inc(failed)
        if gap:
            log.info("deltas from %s were lost (seq %d after %d): resyncing", wid, fresh[0][0], link.applied)
            asyncio.get_running_loop().create_task(self.resync(wid))
        self._resync_returned()
        return any(d[3] not in HOST_STATES for d in fresh)  # a host tier's changes alone change no plan

    def _new_incarnation(self, wid: WorkerId, incarnation: int) -> bool:
        """Note a worker's incarnation; a newer one starts empty. False: an older one (ignore it)."""
        link = self.links.get(wid)
        if link is not None and incarnation < link.incarnation:
            return False
        if link is None or incarnation > link.incarnation:
            if link is not None:  # restarted: empty, but alive (it said so)
                self.publish(self.core.worker_lost(wid, gone=False))
            self.links[wid] = Link(incarnation, 0)
        return True

    async def resync(self, wid: WorkerId) -> None:
        """Repair lost deltas (or commands): replace what is known of a worker by its full report."""
        losses, handle = self.losses.get(wid, 0), self.handles.get(wid)
        try:
            info = await asyncio.wait_for(self.handles[wid].describe.remote(), timeout=self.call_timeout_s)
        except Exception as e:  # lost or hung: the health loop deals with it
            log.info("resync of %s failed: %s", wid, type(e).__name__ if isinstance(e, TimeoutError) else e)
            return
        if self.losses.get(wid, 0) != losses or self.handles.get(wid) is not handle:
            return  # lost (or replaced) while it answered: the report may be from before its death
        link = self.links.get(wid)
        if link is not None and (info["incarnation"], info["seq"]) < (link.incarnation, link.applied):
            return  # older than deltas already applied: the next resync repairs any gap
        self.links[wid] = Link(info["incarnation"], info["seq"])
        self.publish(self.core.sync_worker(wid, info["residency"], info.get("host")))
        self._resync_returned()
        await self.replan()

    def _resync_returned(self) -> None:
        """The ranks of a replica whole again whose plans were withheld meanwhile: read their full reports."""
        for wid in self.core.lost.returned():
            if wid in self.handles:
                asyncio.get_running_loop().create_task(self.resync(wid))

    async def resync_all(self) -> None:
        """Anti-entropy: whatever was lost is repaired. Each worker's resync runs by itself (one at a time per
        worker): a stopped worker's ``describe`` (up to ``call_timeout_s``) does not hold up the health loop's
        pings, which find it lost within ``ping_timeout_s``."""
        for wid in list(self.handles):
            self.resync_soon(wid)

    def resync_soon(self, wid: WorkerId) -> None:
        """A resync of ``wid`` in the background, unless one is in flight."""
        if wid in self.resyncing:
            return
        self.resyncing.add(wid)
        task = asyncio.get_running_loop().create_task(self.resync(wid))
        task.add_done_callback(lambda _: self.resyncing.discard(wid))

    async def ping_all(self) -> None:
        """One ping each, all at once; a worker that leaves ``PING_MISSES`` in a row unanswered within
        ``ping_timeout_s`` lost what it held (dropped in the workers' order). One hung worker delays the others'
        checks by no more than that."""
        pinged = [(wid, handle, self._incarnation(wid)) for wid, handle in self.handles.items()]
        answers = await asyncio.gather(*(asyncio.wait_for(h.ping.remote(), timeout=self.ping_timeout_s)
                                         for _, h, _ in pinged), return_exceptions=True)
        for (wid, handle, incarnation), answer in zip(pinged, answers):
            if not isinstance(answer, BaseException) or self.quiet:
                self.missed.pop(wid, None)
                continue
            if self.handles.get(wid) is not handle or self._incarnation(wid) != incarnation:
                continue  # a new process under the name reported meanwhile: the miss was its predecessor's
            count, by = self.missed.get(wid, (0, None))
            # a new process under the name starts again: a new handle (attached), or the same one (Ray restarted
            # the actor) with a new incarnation reported
            count = count + 1 if by == (handle, incarnation) else 1
            self.missed[wid] = (count, (handle, incarnation))
            if count < PING_MISSES:
                continue
            if wid not in self.core.lost.down:
                log.warning("worker %s is not answering (%s): dropping its residency", wid,
                            type(answer).__name__)  # dead, restarting or hung
            self.lose(wid, f"{count} pings in a row unanswered within {self.ping_timeout_s} s "
                           f"({type(answer).__name__})")

    def _incarnation(self, wid: WorkerId) -> int | None:
        link = self.links.get(wid)
        return None if link is None else link.incarnation

    def lose(self, wid: WorkerId, cause: str = "") -> None:
        """``wid`` is dead, hung or gone: its replica stops being ready for what it held, now (before any
        later lookup, route or event is answered), and leaves the plans and the routes until it reports."""
        if self.quiet:
            return  # the whole service is stopping: nothing will be served again
        self.losses[wid] = self.losses.get(wid, 0) + 1
        self.publish(self.core.worker_lost(wid, now=time.time(), cause=cause))

    @property
    def quiet(self) -> bool:
        """The service is being stopped (``quiesce``): its workers' deaths are not losses."""
        return self.lifelines.closed

    def quiesce(self) -> None:
        """Stop watching every worker (lifelines closed, no new ones; pings and reports of a death ignored):
        the service's owner is stopping it."""
        self.lifelines.close()

    # -- commands (step 4, invariant 7) -------------------------------------------------------------
    def send(self, plan: dict[WorkerId, list[Command]]) -> None:
        """Each linked worker its commands; the results are read as they come."""
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
            if self.quiet:
                return
            log.warning("commands to %s were lost (%s); resyncing it", wid, e)
            await self.resync(wid)

    # -- registrations replayed to a new or restarted worker (step 0) ------------------------------
    async def replay(self, handles: list[Any]) -> None:
        """Workers new to the controller (or restarted, catalog empty) learn every registered adapter, with
        the versions the controller hashed, ``REPLAY_ENTRIES`` at a time (a ping waits behind one call at
        most). A restarted worker says so from its constructor, so it may still be starting."""
        names = list(self.core.paths)  # one registered later reaches these workers by itself (they are linked)
        for start in range(0, len(names), REPLAY_ENTRIES):
            await while_restarting(functools.partial(self._register_on, handles, names[start:start + REPLAY_ENTRIES]))

    async def _register_on(self, handles: list[Any], names: list[str]) -> None:
        """``names`` as registered now (read at the moment they are sent, with no await before: a registration
        applied while an earlier chunk was on its way is not sent back in its old version), on ``handles``."""
        entries = [(n, self.core.paths[n], self.core.catalog.known(n)) for n in names
                   if n in self.core.paths and n in self.core.catalog]
        for answer in await asyncio.gather(*(h.register_adapters.remote(entries) for h in handles)):
            for (name, _, _), (_, error) in zip(entries, answer):
                if error:
                    log.warning("a worker refused adapter %s: %s", name, error)
